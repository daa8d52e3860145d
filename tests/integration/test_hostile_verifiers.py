"""A GRPO run on the tiny model with hostile verifiers: one reward hangs forever on 1 in 5 groups, one
segfaults its process on another 1 in 5, one allocates without bound on a third. The run finishes its steps,
each failure dropped and counted under its own reason; the held-out evaluations go on (a failed example
scores 0). `python -m tests.integration.test_hostile_verifiers OUT_DIR` prints the figures of docs/benchmarks.md."""

import asyncio
import json
import sys
import time

from forge_rl.config import load_config
from forge_rl.recipes.grpo import GRPOConfig, main
from tests.conftest import REPO

STEPS = 3
HOSTILE = (
    "rewards=[{name: exact_match, weight: 1.0}, "
    "{name: 'tests.support.hostile_rewards:hangs', weight: 0.0, args: {one_in: 5, residue: 0}}, "
    "{name: 'tests.support.hostile_rewards:segfaults', weight: 0.0, args: {one_in: 5, residue: 1}}, "
    "{name: 'tests.support.hostile_rewards:allocates', weight: 0.0, args: {one_in: 5, residue: 2}}]"
)


def hostile_run(out_dir) -> tuple[dict, float]:
    cfg = load_config(
        GRPOConfig,
        REPO / "configs/grpo/tiny.yaml",
        [
            f"steps={STEPS}",
            "batch_groups=4",
            "group_size=4",
            "rollout_tasks=2",
            "eval_size=16",
            "eval_every=0",
            "buffer.capacity=8",
            "generator.sampling.max_tokens=6",
            "buffer.drop_zero_advantage=false",
            f"output_dir={out_dir}",
            "reward_timeout_s=2",
            "reward_workers=2",
            "reward_memory_mb=384",
            HOSTILE,
        ],
    )
    start = time.perf_counter()
    summary = asyncio.run(main(cfg))
    return summary, time.perf_counter() - start


def test_hostile_verifiers_cost_their_groups_not_the_run(tmp_path):
    summary, _ = hostile_run(tmp_path)
    assert summary["steps"] == STEPS and summary["trainer_version"] == STEPS
    drops = summary["drops"]
    assert drops["reward_timeout"] > 0 and drops["reward_crash"] > 0 and drops["reward_memory"] > 0, drops
    assert len(summary["evals"]) == 2


if __name__ == "__main__":
    summary, wall = hostile_run(sys.argv[1])
    print(
        json.dumps(
            {
                "steps": summary["steps"],
                "wall_s": round(wall, 1),
                "run_wall_s": round(summary["wall_s"], 1),
                "steps_per_min": round(summary["steps_per_min"], 2),
                "trained": summary["buffer"]["trained"],
                "drops": {k: v for k, v in summary["drops"].items() if v},
            },
            indent=1,
        )
    )
