"""Plain GRPO: a hand-written single-process loop (HF generate + PyTorch), the baseline for `make demo`.

    .venv/bin/python -m benchmarks.plain_grpo [--steps 150] [--eval-every 25] [--threads N] [--out PATH]

Same work as apps/grpo/main.py with configs/grpo/tiny.yaml: tiny-warm model, training prompts in order,
G=8 samples per prompt at temperature 1.0 (8 new tokens), exact-match (1.0) + format (0.1) rewards, group
advantages scaled by std, zero-advantage groups dropped, 16 usable groups per step, clipped GRPO loss
(0.2/0.28, sequence mean), AdamW 1e-4, grad clip 1.0, greedy exact-match accuracy on 500 held-out prompts
before training, every --eval-every steps and at the end. Everything runs in this process, one step after
the other: sample, score, train.

Prints a table of held-out accuracy against training time (evaluations excluded) and writes a JSON
summary (steps, train_s, steps_per_min, evals [[step, train_s, accuracy], ...], eval_first,
eval_last3_mean, time_to_60, dropped_zero_advantage, generated_episodes) to --out.
"""

import argparse
import itertools
import json
import os
import statistics
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from forge_rl.data.arithmetic import chat_prompt, held_out_problems, iter_training_problems
from forge_rl.losses.advantages import group_advantages
from forge_rl.losses.config import LossConfig
from forge_rl.losses.grpo import per_token_loss, reduce_loss
from forge_rl.models import resolve_model_path
from forge_rl.rewards.exact_match import exact_match
from forge_rl.rewards.format import digits_format

REWARDS = [(exact_match, 1.0), (digits_format, 0.1)]  # the demo's rewards and weights
LOSS = LossConfig(clip_low=0.2, clip_high=0.28, normalize="sequence_mean")


def generate(model, tok, problems, n: int, max_tokens: int, greedy: bool = False) -> list[dict]:
    """n completions per problem (problem-major) as {prompt_ids, response_ids, text, finish_reason};
    response_ids run up to and including EOS, as vLLM reports them."""
    enc = tok([chat_prompt(tok, p) for p in problems], return_tensors="pt", padding=True, add_special_tokens=False)
    sampling = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
    out = model.generate(
        **enc,
        **sampling,
        num_return_sequences=n,
        max_new_tokens=max_tokens,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    P = enc.input_ids.shape[1]
    episodes = []
    for i, row in enumerate(out):
        prompt = row[:P][enc.attention_mask[i // n].bool()]
        response = row[P:]
        stops = (response == tok.eos_token_id).nonzero()
        if len(stops):
            response = response[: int(stops[0]) + 1]
        episodes.append(
            dict(
                prompt_ids=prompt,
                response_ids=response,
                finish_reason="stop" if len(stops) else "length",
                text=tok.decode(response, skip_special_tokens=True),
            )
        )
    return episodes


def collate(episodes: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Prompts left-padded, responses right-padded, so every response starts at column P."""
    P = max(len(e["prompt_ids"]) for e in episodes)
    R = max(len(e["response_ids"]) for e in episodes)
    ids = torch.full((len(episodes), P + R), pad_id)
    attn = torch.zeros_like(ids)
    for i, e in enumerate(episodes):
        p, r = len(e["prompt_ids"]), len(e["response_ids"])
        ids[i, P - p : P], ids[i, P : P + r] = e["prompt_ids"], e["response_ids"]
        attn[i, P - p : P + r] = 1
    return dict(ids=ids, attn=attn, P=P, mask=attn[:, P:].bool())


def response_logprobs(model, b: dict) -> torch.Tensor:
    """log pi(token | prefix) of every response column [B, R]; positions as generate gives them under left padding."""
    pos = (b["attn"].cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=b["ids"], attention_mask=b["attn"], position_ids=pos).logits
    logp = torch.log_softmax(logits[:, b["P"] - 1 : -1].float() / 1.0, dim=-1)  # / the sampling temperature
    return logp.gather(-1, b["ids"][:, b["P"] :, None])[..., 0]


def score(episodes: list[dict], answer: str) -> list[float]:
    texts, n = [e["text"] for e in episodes], len(episodes)
    parts = [
        fn([""] * n, texts, answer=[answer] * n, finish_reason=[e["finish_reason"] for e in episodes])
        for fn, _ in REWARDS
    ]
    return [sum(w * p[i] for (_, w), p in zip(REWARDS, parts)) for i in range(n)]


@torch.no_grad()
def evaluate(model, tok, problems, max_tokens: int, chunk: int = 250) -> float:
    texts = [
        e["text"]
        for i in range(0, len(problems), chunk)
        for e in generate(model, tok, problems[i : i + chunk], 1, max_tokens, greedy=True)
    ]
    return sum(exact_match([], texts, answer=[p.answer for p in problems])) / len(problems)


def run(args) -> dict:
    torch.set_num_threads(args.threads or len(os.sched_getaffinity(0)))
    torch.manual_seed(args.seed)
    path = resolve_model_path("tiny-warm")
    tok = AutoTokenizer.from_pretrained(path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()  # no dropout in this model; eval mode keeps generate and the loss forward identical
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    prompts, held_out = iter_training_problems(args.seed), held_out_problems(args.eval_size)
    evals = [[0, 0.0, evaluate(model, tok, held_out, args.max_tokens)]]
    train_s, dropped, generated = 0.0, 0, 0
    bar = tqdm(range(1, args.steps + 1), desc="plain GRPO", unit="step")
    for step in bar:
        start = time.perf_counter()
        groups, rewards = [], []  # usable groups: (episodes, advantages)
        while (missing := args.batch_groups - len(groups)) > 0:  # top up like the replay buffer fills
            problems = list(itertools.islice(prompts, missing))
            with torch.no_grad():
                episodes = generate(model, tok, problems, args.group_size, args.max_tokens)
            generated += len(episodes)
            for k, problem in enumerate(problems):
                group = episodes[k * args.group_size : (k + 1) * args.group_size]
                totals = score(group, problem.answer)
                rewards += totals
                adv = group_advantages(totals, scale_by_std=True)
                if all(abs(a) < 1e-8 for a in adv):  # no signal: dropped, as drop_zero_advantage does
                    dropped += len(group)
                else:
                    groups.append((group, adv))
        batch = collate([e for g, _ in groups for e in g], tok.pad_token_id)
        advantages = torch.tensor([a for _, adv in groups for a in adv])
        with torch.no_grad():  # behaviour logprobs: the weights that sampled these tokens (on-policy)
            behaviour = response_logprobs(model, batch)
        token_loss, _ = per_token_loss(response_logprobs(model, batch), behaviour, advantages, LOSS)
        mask = batch["mask"]
        loss = reduce_loss(token_loss, mask, LOSS.normalize, len(advantages), int(mask.sum()))
        opt.zero_grad()
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        train_s += time.perf_counter() - start
        if not (torch.isfinite(loss) and torch.isfinite(grad_norm)):
            raise FloatingPointError(f"step {step}: loss {loss.item()}, grad norm {grad_norm.item()}")
        bar.set_postfix(
            reward=f"{statistics.mean(rewards):.2f}",
            loss=f"{loss.item():+.1e}",
            gnorm=f"{grad_norm.item():.2f}",
            acc=f"{evals[-1][2]:.0%}",
            s_step=f"{train_s / step:.2f}",
        )
        if (args.eval_every and step % args.eval_every == 0) or step == args.steps:  # the demo's schedule
            evals.append([step, train_s, evaluate(model, tok, held_out, args.max_tokens)])
    bar.close()
    summary = dict(
        steps=args.steps,
        train_s=train_s,
        steps_per_min=args.steps / train_s * 60,
        evals=evals,
        eval_first=evals[0][2],
        eval_last3_mean=statistics.mean(acc for *_, acc in evals[-3:]),
        time_to_60=next((t for _, t, acc in evals if acc >= 0.6), None),
        dropped_zero_advantage=dropped,
        generated_episodes=generated,
    )
    table = Table(title=f"plain GRPO, {args.steps} steps, {args.eval_size} held-out prompts (greedy)")
    for col in ("step", "train s", "accuracy"):
        table.add_column(col, justify="right")
    for step, t, acc in evals:
        table.add_row(str(step), f"{t:.1f}", f"{acc:.1%}")
    console = Console()
    console.print(table)
    console.print(
        f"{summary['steps_per_min']:.1f} steps/min ({train_s / args.steps:.2f} s/step); dropped "
        f"{dropped} of {generated} generated episodes (zero advantage); time to 60%: {summary['time_to_60']}"
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2))
    return summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch-groups", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--eval-every", type=int, default=25, help="steps; 0 = only before and after")
    ap.add_argument("--eval-size", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch threads; 0 = every core this process may use")
    ap.add_argument("--out", default="outputs/plain_grpo/summary.json")
    return ap.parse_args(argv)


if __name__ == "__main__":
    run(parse_args())
