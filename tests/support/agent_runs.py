"""The smallest synchronous GRPO run an agent test trains on: two groups of two, six-token replies, no evaluation,
no export. The agent tests (endpoint, workers, verifiers) add their agent's keys and the steps they take."""

SMALL_SYNC_RUN = [
    "batch_groups=2",
    "group_size=2",
    "rollout_tasks=2",
    "eval_size=4",
    "eval_every=0",
    "buffer.capacity=4",
    "buffer.drop_zero_advantage=false",
    "generator.sampling.max_tokens=6",
    "async_mode=false",
    "max_policy_age=0",
    "export_dir=null",
]
