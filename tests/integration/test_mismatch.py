"""The train/inference mismatch is measured every step of a GRPO run: near zero when the trainer reproduces the
generator's numerics (fp32 both, synchronous, so no token is stale), clearly above it when the trainer computes in
bf16 against the engine's fp32. And each is_correction trains in a run."""

import asyncio

from forge_rl.observability.metrics import read_jsonl
from forge_rl.recipes.grpo import GRPOConfig, main
from forge_rl.recipes.grpo_report import console_line, summary_block
from forge_rl.config import load_config
from tests.conftest import REPO

SYNC_SMALL = [
    "batch_groups=2",
    "group_size=4",
    "rollout_tasks=2",
    "eval_size=8",
    "eval_every=0",
    "buffer.capacity=4",
    "generator.sampling.max_tokens=6",
    "async_mode=false",
    "max_policy_age=0",
    "steps=2",
    "checkpoint_every=0",
    "export_dir=null",
]


def _steps(tmp_path, name: str, overrides: list[str]) -> list[dict]:
    cfg = load_config(
        GRPOConfig, REPO / "configs/grpo/tiny.yaml", SYNC_SMALL + [f"output_dir={tmp_path / name}", *overrides]
    )
    summary = asyncio.run(main(cfg))
    steps = [r for r in read_jsonl(tmp_path / name / "metrics.jsonl") if "trainer/loss" in r]
    # what the console shows: every step's line and the summary at the end
    assert summary["mismatch_abs_max"] == max(r["trainer/mismatch_abs_max"] for r in steps)
    assert f"mismatch {steps[-1]['trainer/mismatch_abs_mean']:.1e}" in console_line(len(steps), steps[-1])
    block = summary_block(summary, "exact_match", tmp_path, tmp_path, tmp_path, None, False, None)
    assert f"|log pi - log mu| {summary['mismatch_abs_mean']:.1e} mean over steps" in block
    return steps


def test_mismatch_is_near_zero_when_numerics_agree_and_not_when_the_trainer_runs_bf16(tmp_path):
    same = _steps(tmp_path, "fp32", [])
    bf16 = _steps(tmp_path, "bf16", ["trainer.dtype=bfloat16", "trainer.loss.is_correction=icepop"])
    for r in same:  # synchronous and fp32 on both sides: only kernel-order rounding remains
        assert r["trainer/mismatch_abs_mean"] < 1e-4 and r["trainer/mismatch_abs_max"] < 1e-3
        assert abs(r["trainer/mismatch_k3"]) < 1e-6
        assert "trainer/is_weight_mean" not in r
    for r in bf16:
        assert r["trainer/mismatch_abs_mean"] > 1e-3 and r["trainer/mismatch_abs_max"] >= r["trainer/mismatch_abs_mean"]
        assert r["trainer/mismatch_k3"] > 0
        assert 0 < r["trainer/is_weight_mean"] <= 2.0 and 0 <= r["trainer/is_corrected_fraction"] < 1
    means = [r["trainer/mismatch_abs_mean"] for r in bf16]
    assert min(means) > 30 * max(r["trainer/mismatch_abs_mean"] for r in same)


def test_truncated_sampling_from_the_config_is_reproduced_over_the_kept_sets(tmp_path):
    """Keep Sampling Mask through the config: a GRPO run sampling with top_p=0.95 and top_k=20 at T=0.7 (Qwen3's
    recommendation) trains with the trainer's logprobs over each token's recorded kept set (micro-batches, shared
    prompts, the entropy over the set): |log pi - log mu| as small as untruncated. The per-call samplers:
    tests/integration/test_generator.py."""
    steps = _steps(
        tmp_path,
        "top_p_top_k",
        ["generator.sampling.temperature=0.7", "generator.sampling.top_p=0.95", "generator.sampling.top_k=20"],
    )
    for r in steps:
        assert r["trainer/mismatch_abs_mean"] < 1e-4 and r["trainer/mismatch_abs_max"] < 1e-3
        assert 4 < r["generator/sampling_mask_bytes_per_token"] <= 4 * 21 + 4  # ids and an offset per token
        assert r.get("drops/sampling_mask_over_cap", 0) == 0
