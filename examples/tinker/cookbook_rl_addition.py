"""RL on 2-digit addition with tinker-cookbook's own RL training code (`tinker_cookbook.rl.train.main`, unchanged)
against a Tinker service. Only the task is written here, as a cookbook environment: one `ProblemEnv` per sampled
answer to "a+b=", a group of them per question, and an evaluator of greedy held-out accuracy (`make demo`'s measure).
The loop, advantages, datums, logging and checkpoints are the cookbook's.

    python examples/tinker/cookbook_rl_addition.py --service-json outputs/tinker/service.json [--steps 100]

The model is named by its local directory (the service's `model_path`), so the cookbook loads its tokenizer from
disk. Metrics land in --out/metrics.jsonl (the cookbook's), and the curves in --out/curves.png.
"""

import argparse
import asyncio
import json
import os
from functools import partial
from pathlib import Path

import chz
import numpy as np
import tinker
from rl_addition import problems  # the same questions and held-out set as the tinker-client loop beside this file
from tinker_cookbook import renderers
from tinker_cookbook.eval.evaluators import SamplingClientEvaluator
from tinker_cookbook.rl import train
from tinker_cookbook.rl.problem_env import ProblemEnv, ProblemGroupBuilder
from tinker_cookbook.rl.types import RLDataset, RLDatasetBuilder
from tinker_cookbook.tokenizer_utils import get_tokenizer

# the chat template of the embedded models is Qwen3's without a thinking block
RENDERER = "qwen3_instruct"


class AdditionEnv(ProblemEnv):
    """One answer to "a+b=": reward 1 when the reply is exactly the sum, else 0 (make demo's reward)."""

    def __init__(self, question: str, answer: str, renderer: renderers.Renderer):
        super().__init__(renderer, format_coef=0.0)
        self.question, self.answer = question, answer

    def get_question(self) -> str:
        return self.question

    def check_answer(self, sample_str: str) -> bool:
        return sample_str.strip() == self.answer

    def check_format(self, sample_str: str) -> bool:
        return True

    def get_reference_answer(self) -> str:
        return self.answer


class AdditionDataset(RLDataset):
    """`batch` questions a step, each a group of `group` answers."""

    def __init__(self, questions: list[tuple[str, str]], batch: int, group: int, renderer: renderers.Renderer):
        self.questions, self.batch, self.group, self.renderer = questions, batch, group, renderer

    def get_batch(self, index: int) -> list[ProblemGroupBuilder]:
        chunk = self.questions[index * self.batch : (index + 1) * self.batch]
        return [
            ProblemGroupBuilder(partial(AdditionEnv, q, a, self.renderer), num_envs=self.group, dataset_name="addition")
            for q, a in chunk
        ]

    def __len__(self) -> int:
        return len(self.questions) // self.batch


class GreedyAccuracy(SamplingClientEvaluator):
    """The share of held-out questions answered exactly with one greedy answer each."""

    def __init__(self, model_path: str, eval_size: int, max_tokens: int):
        self.renderer = renderers.get_renderer(RENDERER, tokenizer=get_tokenizer(model_path))
        self.questions = problems(eval_size, seed=20261202)
        stop = self.renderer.get_stop_sequences()
        self.params = tinker.SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=stop)

    async def answer(self, sampling_client: tinker.SamplingClient, question: str) -> str:
        prompt = self.renderer.build_generation_prompt([{"role": "user", "content": question}])
        result = await sampling_client.sample_async(prompt, num_samples=1, sampling_params=self.params)
        return renderers.get_text_content(self.renderer.parse_response(result.sequences[0].tokens)[0]).strip()

    async def __call__(self, sampling_client: tinker.SamplingClient) -> dict[str, float]:
        answers = await asyncio.gather(*(self.answer(sampling_client, q) for q, _ in self.questions))
        return {"held_out/greedy_accuracy": float(np.mean([a == r for a, (_, r) in zip(answers, self.questions)]))}


@chz.chz
class AdditionDatasetBuilder(RLDatasetBuilder):
    model_path: str
    batch: int
    group: int
    steps: int
    eval_size: int
    seed: int = 0

    async def __call__(self) -> tuple[AdditionDataset, None]:
        renderer = renderers.get_renderer(RENDERER, tokenizer=get_tokenizer(self.model_path))
        held_out = frozenset(q for q, _ in problems(self.eval_size, seed=20261202))
        return AdditionDataset(
            problems(self.batch * self.steps, self.seed, held_out), self.batch, self.group, renderer
        ), None


async def evaluate_final(info: dict, out: Path, evaluator: GreedyAccuracy, step: int) -> None:
    """The cookbook evaluates before a step; the weights its last step made are evaluated here, from its final
    checkpoint, and added to its metrics.jsonl."""
    final = json.loads((out / "checkpoints.jsonl").read_text().splitlines()[-1])
    service = tinker.ServiceClient(base_url=info["base_url"])
    metrics = await evaluator(service.create_sampling_client(model_path=final["sampler_path"]))
    with open(out / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": step, **metrics}) + "\n")


def plot(out: Path) -> None:
    """The cookbook's metrics.jsonl as two curves: the sampled reward per step and the held-out accuracy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.5))
    trained = [r for r in rows if "env/all/reward/total" in r]
    left.plot([r["step"] for r in trained], [r["env/all/reward/total"] for r in trained])
    left.set(xlabel="step", ylabel="mean reward (sampled)")
    evals = [r for r in rows if "held_out/greedy_accuracy" in r]
    right.plot([r["step"] for r in evals], [r["held_out/greedy_accuracy"] for r in evals], marker="o")
    right.set(xlabel="step", ylabel="greedy held-out accuracy")
    fig.tight_layout()
    fig.savefig(out / "curves.png", dpi=100)


def connect(parser: argparse.ArgumentParser, service_json: str) -> dict:
    """The running service's base URL, key and model directory from its service.json; the key is handed to the
    tinker client the client's own way (TINKER_API_KEY). A missing file ends in one line saying what to start."""
    path = Path(service_json)
    if not path.is_file():
        parser.error(f"--service-json {path}: no such file; start the service first (python -m apps.tinker.main)")
    info = json.loads(path.read_text())
    os.environ["TINKER_API_KEY"] = info["api_key"]
    return info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--service-json", required=True, help="a forge_rl service's output_dir/service.json")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=16, help="questions per step")
    parser.add_argument("--group", type=int, default=8, help="sampled answers per question")
    parser.add_argument("--lr", type=float, default=3e-5)
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank (a full fine-tuning service ignores it)")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--eval-size", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--off-policy", type=int, default=0,
        help="0: the cookbook's synchronous loop; k > 0: its async loop, sampling the next steps while one trains and "
        "training on samples at most k steps old (a LoRA service keeps kept_saves saves servable)",
    )  # fmt: skip
    parser.add_argument("--out", default="outputs/tinker_cookbook")
    args = parser.parse_args()
    info = connect(parser, args.service_json)
    builder = AdditionDatasetBuilder(
        model_path=info["model_path"], batch=args.batch, group=args.group, steps=args.steps,
        eval_size=args.eval_size, seed=args.seed,
    )  # fmt: skip
    evaluator = GreedyAccuracy(info["model_path"], args.eval_size, args.max_tokens)
    config = train.Config(
        learning_rate=args.lr, dataset_builder=builder, model_name=info["model_path"], recipe_name="forge_rl_addition",
        max_tokens=args.max_tokens, log_path=args.out, base_url=info["base_url"], renderer_name=RENDERER,
        lora_rank=args.rank, eval_every=args.eval_every, save_every=0, max_steps=args.steps,
        remove_constant_reward_groups=True, evaluator_builders=[lambda: evaluator] if args.eval_size else [],
        async_config=train.AsyncConfig(max_steps_off_policy=args.off_policy, groups_per_batch=args.batch)
        if args.off_policy else None,
    )  # fmt: skip
    asyncio.run(train.main(config))
    if args.eval_size:
        asyncio.run(evaluate_final(info, Path(args.out), evaluator, args.steps))
    plot(Path(args.out))


if __name__ == "__main__":
    main()
