"""Keep Routing on tiny-moe: how often the trainer's routers choose other experts than the engine did, and the
train/inference logprob mismatch with and without replaying the engine's choice, in fp32 and in bf16.

    .venv/bin/python -m benchmarks.keep_routing [--groups 16] [--group-size 8] [--max-tokens 48] [--out DIR]

For each dtype: a Generator (vLLM, engine dtype = that dtype, record_routes=True) samples `groups` x `group-size`
completions at T=1 of random-token prompts; the trainer's model (TorchTitan's Qwen3-MoE as the Trainer builds it,
fp32 weights, bf16 autocast for bf16 as the trainer's compute dtype does) scores every completion twice: its routers
choosing (as without trainer.keep_routing) and replaying the recorded experts (trainer.keep_routing=true). Reported:
the share of (position, layer) pairs and of response tokens (any layer) whose trainer top-k differs from the
engine's, and |log pi_trainer - log pi_engine| over response tokens (mean, max) each way. Writes keep_routing.md
and .json into --out.
"""

import argparse
import asyncio
import json
import random
import time
from pathlib import Path

import torch

from forge_rl.models import resolve_model_path

TINY_MOE = resolve_model_path("tiny-moe")


async def sample(dtype: str, groups: int, group_size: int, max_tokens: int, seed: int) -> list:
    from forge_rl.actors.generator import Generator
    from forge_rl.runtime import provisioned

    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 128) for _ in range(rng.randrange(8, 24))] for _ in range(groups)]
    async with provisioned():
        generator = await Generator.as_actor(
            str(TINY_MOE), engine_args=dict(dtype=dtype, max_model_len=128), record_routes=True, seed=seed
        )
        results = await asyncio.gather(
            *(generator.generate.call_one(p, n=group_size, temperature=1.0, max_tokens=max_tokens) for p in prompts)
        )
    return [c for group in results for c in group]


def score(completions: list, dtype: str) -> dict:
    from forge_rl.models.qwen3 import build_model
    from forge_rl.models.route_replay import RouteReplay

    model, _ = build_model(TINY_MOE)
    model.eval()
    replay = RouteReplay(model)
    own: dict[int, torch.Tensor] = {}
    for layer, router in enumerate(replay.routers):
        router.register_forward_hook(lambda m, i, out, layer=layer: own.__setitem__(layer, out[1][0].detach()))
    pairs = differ_pairs = tokens = differ_tokens = 0
    gaps = {"free": [], "replay": []}
    rerouted = []  # per response token: whether the trainer's routers chose other experts at a layer of its position
    for c in completions:
        ids = torch.cat([c.prompt_ids, c.response_ids])[None]
        P, R = len(c.prompt_ids), len(c.response_ids)
        engine = c.routes.long().sort(-1).values  # [P + R - 1, layers, top-k]
        # the last token was never run by the engine: no record, as TrainBatch.collate leaves it
        recorded = torch.cat([c.routes.short(), torch.full((1, *c.routes.shape[1:]), -1, dtype=torch.int16)])
        for mode in ("free", "replay"):
            replay.set(recorded[None] if mode == "replay" else None)
            # the trainer's compute: fp32 weights, bf16 autocast for a bf16 trainer (no FSDP: torch.autocast)
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
                logits = model(ids)[0].float()
            logprobs = torch.log_softmax(logits[P - 1 : P + R - 1], -1).gather(-1, c.response_ids[:, None])[:, 0]
            gaps[mode].append((logprobs - c.logprobs).abs())
            if mode == "free":
                chosen = torch.stack([own[layer] for layer in range(len(own))], 1)[: P + R - 1].sort(-1).values
                differs = (chosen != engine).any(-1)  # [positions, layers]
                pairs += differs.numel()
                differ_pairs += int(differs.sum())
                tokens += R  # positions P-1 .. P+R-2 predict the response tokens
                differ_tokens += int(differs[P - 1 :].any(-1).sum())
                rerouted.append(differs[P - 1 :].any(-1))
        replay.stats()
    free, replayed, rerouted = torch.cat(gaps["free"]), torch.cat(gaps["replay"]), torch.cat(rerouted)
    at = (lambda gap: float(gap[rerouted].mean())) if rerouted.any() else (lambda gap: float("nan"))
    return dict(
        dtype=dtype,
        completions=len(completions),
        response_tokens=tokens,
        routes_bytes_per_token=completions[0].routes.shape[1]
        * completions[0].routes.shape[2]
        * completions[0].routes.element_size(),
        pairs_differ=differ_pairs / pairs,
        tokens_differ=differ_tokens / tokens,
        free_mean=float(free.mean()),
        free_max=float(free.max()),
        replay_mean=float(replayed.mean()),
        replay_max=float(replayed.max()),
        # on the response tokens whose own position the trainer's routers routed elsewhere
        rerouted_free_mean=at(free),
        rerouted_replay_mean=at(replayed),
    )


def table(rows: list[dict]) -> str:
    lines = [
        "| engine and trainer | (position, layer) pairs routed differently | response tokens routed differently "
        "(any layer) | mismatch mean, trainer routes | mismatch mean, replayed | mismatch max, trainer routes | "
        "mismatch max, replayed | mismatch mean on the rerouted tokens, trainer routes | the same, replayed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['dtype']} | {r['pairs_differ']:.2%} | {r['tokens_differ']:.2%} | {r['free_mean']:.2e} | "
            f"{r['replay_mean']:.2e} | {r['free_max']:.2e} | {r['replay_max']:.2e} | "
            f"{r['rerouted_free_mean']:.2e} | {r['rerouted_replay_mean']:.2e} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="outputs/keep_routing")
    args = ap.parse_args()
    rows = []
    for dtype in ("float32", "bfloat16"):
        start = time.perf_counter()
        completions = asyncio.run(sample(dtype, args.groups, args.group_size, args.max_tokens, args.seed))
        rows.append(score(completions, dtype))
        print(f"{dtype}: {len(completions)} completions scored in {time.perf_counter() - start:.0f} s", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "keep_routing.json").write_text(json.dumps(rows, indent=2))
    (out / "keep_routing.md").write_text(table(rows) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
