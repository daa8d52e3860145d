"""The overrides of configs/grpo/tiny.yaml for a short seeded synchronous run: the same config gives the same tokens,
losses and final weights, fp32 on CPU (tests/integration/test_reproducibility.py, benchmarks/chaos.py)."""

SEEDED_SYNC = [
    "seed=7",
    "async_mode=false",
    "max_policy_age=0",
    "batch_groups=4",
    "group_size=4",
    "rollout_tasks=4",
    "buffer.capacity=8",
    "generator.sampling.max_tokens=6",
]
