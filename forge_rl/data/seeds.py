"""Per-request sampling seeds: each group's engine request is seeded from the run's seed, its example and its draw, so
a seeded run samples the same tokens whatever order its concurrent requests reach the engine in, resumed or not.
The dataset actor gives each example it hands out its seed (`TaskExample.seed`); the rollout passes it to the
generator, and vLLM seeds sample i of the group with seed + i."""

import hashlib

# Per-request seeds stay below this, so that vLLM's children of an n-sample request (seed + index) stay in range.
REQUEST_SEED_BITS = 62


def request_seed(run_seed: int, example_id: str, draw: int) -> int:
    """The sampling seed of one group's engine request: a function of the run's seed, the example's id and its draw
    (the how-many-th example the run's dataset handed out), so the same run samples the same tokens whatever the
    order in which concurrent requests reach the engine, and a resumed run (whose dataset restores its draw count)
    samples what the uninterrupted one did. vLLM gives sample i of the group seed + i."""
    digest = hashlib.blake2b(f"{run_seed}:{draw}:{example_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> (64 - REQUEST_SEED_BITS)
