"""The `make demo` path, small: generator service -> rewards -> advantages -> TorchTitan logprob check."""

import asyncio
import json

from apps.rollout.main import RolloutConfig, main
from forge_rl.config import load_config
from tests.conftest import REPO


def test_rollout_app_end_to_end(tmp_path):
    cfg = load_config(
        RolloutConfig,
        REPO / "configs/rollout/tiny.yaml",
        ["num_prompts=4", "group_size=4", "concurrency=2", f"output_dir={tmp_path}", "sampling.max_tokens=6"],
    )
    summary = asyncio.run(main(cfg))
    assert summary["groups"] == 4 and summary["episodes"] == 16
    assert 0.0 <= summary["reward_mean"] <= 1.0
    assert summary["generated_tokens_per_s"] > 0
    assert summary["max_logprob_gap_vllm_vs_torchtitan"] < 1e-4
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    assert (tmp_path / "config.yaml").read_text().startswith("model: tiny")
