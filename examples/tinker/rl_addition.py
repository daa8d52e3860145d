"""RL on 2-digit addition written only against the `tinker` client, in the shape of tinker-cookbook's RL loop:
each step saves the weights for sampling, samples a group of answers per problem, scores them, and trains on them
with `importance_sampling` (group-relative advantages), then takes one optimizer step. It imports nothing of
forge_rl: point it at any Tinker service.

    python examples/tinker/rl_addition.py --base-url http://127.0.0.1:PORT --api-key tml-... [--steps 100]
    python examples/tinker/rl_addition.py --service-json outputs/tinker/service.json

It prints a line per step and the greedy held-out accuracy every --eval-every steps, and writes metrics.jsonl and
curves.png into --out.
"""

import argparse
import json
import random
import time
from pathlib import Path

import numpy as np
import tinker
from tinker import types


def problems(n: int, seed: int, exclude: frozenset = frozenset()) -> list[tuple[str, str]]:
    """`n` distinct "a+b=" questions with their answers, none of them in `exclude`."""
    rng, found = random.Random(seed), {}
    while len(found) < n:
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        if f"{a}+{b}=" not in exclude:
            found[f"{a}+{b}="] = str(a + b)
    return list(found.items())


def prompt_tokens(tokenizer, question: str) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )
    return tokenizer.encode(text, add_special_tokens=False)


def reward(tokenizer, tokens: list[int], answer: str) -> float:
    return float(tokenizer.decode(tokens, skip_special_tokens=True).strip() == answer)


def start_rollouts(sampler, tokenizer, batch, group_size: int, max_tokens: int):
    """Send a group's sample request per problem at once (the service batches them); collect with `rollouts`."""
    params = types.SamplingParams(max_tokens=max_tokens, temperature=1.0)
    prompts = [prompt_tokens(tokenizer, q) for q, _ in batch]
    futures = [
        sampler.sample(types.ModelInput.from_ints(p), num_samples=group_size, sampling_params=params) for p in prompts
    ]
    return batch, prompts, futures


def collect(tokenizer, started):
    """The answers of `start_rollouts`' requests: (prompt tokens, sequences, rewards) per problem."""
    groups = []
    for (_, answer), prompt, future in zip(*started):
        sequences = future.result().sequences
        groups.append((prompt, sequences, [reward(tokenizer, s.tokens, answer) for s in sequences]))
    return groups


def rollouts(sampler, tokenizer, batch, group_size: int, max_tokens: int):
    """A group of sampled answers per problem: (prompt tokens, sequences, rewards) per problem."""
    return collect(tokenizer, start_rollouts(sampler, tokenizer, batch, group_size, max_tokens))


def datums(groups) -> list[types.Datum]:
    """Each sampled answer as a datum: next-token targets, the sampler's logprobs, its group-relative advantage (GRPO's:
    the reward less the group's mean, over the group's standard deviation) on its own tokens (0 on the prompt's),
    divided by its length and the batch's size: a mean over sequences of each sequence's mean."""
    n_seqs = sum(len(seqs) for _, seqs, _ in groups)
    out = []
    for prompt, sequences, rewards in groups:
        advantages = (np.asarray(rewards) - np.mean(rewards)) / (np.std(rewards) + 1e-6)
        for seq, adv in zip(sequences, advantages):
            if adv == 0 or not seq.tokens:
                continue
            ids, pad = prompt + seq.tokens, len(prompt) - 1
            per_token = adv / (len(seq.tokens) * n_seqs)
            out.append(
                types.Datum(
                    model_input=types.ModelInput.from_ints(ids[:-1]),
                    loss_fn_inputs={
                        "target_tokens": np.asarray(ids[1:], dtype=np.int64),
                        "logprobs": np.asarray([0.0] * pad + list(seq.logprobs), dtype=np.float32),
                        "advantages": np.asarray([0.0] * pad + [per_token] * len(seq.tokens), dtype=np.float32),
                    },
                )
            )
    return out


def evaluate(sampler, tokenizer, held_out, max_tokens: int) -> float:
    params = types.SamplingParams(max_tokens=max_tokens, temperature=0.0)
    futures = [
        sampler.sample(types.ModelInput.from_ints(prompt_tokens(tokenizer, q)), num_samples=1, sampling_params=params)
        for q, _ in held_out
    ]
    return float(
        np.mean([reward(tokenizer, f.result().sequences[0].tokens, a) for f, (_, a) in zip(futures, held_out)])
    )


def plot(records: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.5))
    trained = [r for r in records if "reward" in r]
    left.plot([r["step"] for r in trained], [r["reward"] for r in trained])
    left.set(xlabel="step", ylabel="mean reward (sampled)")
    evals = [r for r in records if "held_out" in r]
    right.plot([r["step"] for r in evals], [r["held_out"] for r in evals], marker="o")
    right.set(xlabel="step", ylabel="greedy held-out accuracy")
    fig.tight_layout()
    fig.savefig(out / "curves.png", dpi=100)


class Phases:
    """Seconds of each phase of a step, for the step's record."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def done(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = round(self.seconds.get(phase, 0.0) + now - self._last, 4)
        self._last = now


def train_on(training, tokenizer, groups, args, adam, record: dict, phases: Phases) -> None:
    """The informative groups of a step's rollouts, trained on with importance_sampling, then one Adam step."""
    record["reward"] = float(np.mean([r for _, _, rewards in groups for r in rewards]))
    informative = [g for g in groups if max(g[2]) > min(g[2])][: args.batch]
    record["groups_trained"] = len(informative)
    data = datums(informative)
    if data:
        training.forward_backward(data, "importance_sampling").result()
    phases.done("forward_backward")
    training.optim_step(adam).result()
    phases.done("optim_step")


def train(args) -> list[dict]:
    """The loop. Synchronous, as tinker-cookbook's default: each step samples with the weights it trains. With
    --pipelined, as the cookbook's asynchronous form with one step off policy (and `make demo`'s max_policy_age 1):
    the next step's answers are sampled with this step's weights while this step trains, and importance_sampling
    corrects for the step between them."""
    service = tinker.ServiceClient(base_url=args.base_url, api_key=args.api_key)
    training = service.create_lora_training_client(base_model=args.base_model, rank=args.rank).result()
    tokenizer = training.get_tokenizer()
    held_out = problems(args.eval_size, seed=20261202)
    # more problems than the batch are sampled each step (--sample-factor) and the groups whose answers all scored the
    # same are left out (they carry no advantage), as tinker-cookbook's remove_constant_reward_groups does
    per_step = round(args.sample_factor * args.batch)
    stream = problems(per_step * args.steps, seed=args.seed, exclude=frozenset(q for q, _ in held_out))
    batches = [stream[step * per_step : (step + 1) * per_step] for step in range(args.steps)]
    adam = types.AdamParams(learning_rate=args.lr, beta1=0.9, beta2=0.999, eps=1e-8, grad_clip_norm=1.0)
    records, started, pending = [], time.perf_counter(), None
    for step in range(args.steps + 1):
        phases = Phases()
        groups = collect(tokenizer, pending) if pending else None  # sampled with the previous step's weights
        phases.done("wait_for_samples")
        sampler = training.save_weights_and_get_sampling_client().result()
        phases.done("save_for_sampler")
        record = {"step": step, "time_s": time.perf_counter() - started}
        if held_out and (step % args.eval_every == 0 or step == args.steps):
            record["held_out"] = evaluate(sampler, tokenizer, held_out, args.max_tokens)
            phases.done("evaluate")
        if step < args.steps:
            following = batches[step + 1] if args.pipelined and step + 1 < args.steps else None
            if groups is None:  # synchronous, or the first step
                groups = rollouts(sampler, tokenizer, batches[step], args.group, args.max_tokens)
                phases.done("sample")
            pending = following and start_rollouts(sampler, tokenizer, following, args.group, args.max_tokens)
            train_on(training, tokenizer, groups, args, adam, record, phases)
        record["phases"] = phases.seconds
        records.append(record)
        print(json.dumps(record), flush=True)
    service.close("success").result()  # frees the service's trainer for this client
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url")
    parser.add_argument("--api-key")
    parser.add_argument("--service-json", help="a forge_rl service's output_dir/service.json (base URL and key)")
    parser.add_argument("--base-model", default="tiny-warm")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=16, help="groups trained on per step")
    parser.add_argument("--group", type=int, default=8, help="sampled answers per problem")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--eval-size", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sample-factor", type=float, default=1.5, help="problems sampled per step, in batches")
    parser.add_argument(
        "--pipelined",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="sample the next step while this one trains",
    )
    parser.add_argument("--out", default="outputs/tinker_demo")
    args = parser.parse_args()
    if args.service_json:
        info = json.loads(Path(args.service_json).read_text())
        args.base_url, args.api_key = args.base_url or info["base_url"], args.api_key or info["api_key"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records = train(args)
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    plot(records, out)


if __name__ == "__main__":
    main()
