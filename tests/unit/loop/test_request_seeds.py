"""Per-request sampling seeds (forge_rl/data/seeds.py) and the buffer's batch order: what makes a
seeded run sample and collate the same batch whatever order concurrent rollouts finish in."""

import random

import torch

from forge_rl.actors.generator_engine import unchunked_prefill
from forge_rl.actors.replay_buffer import GroupStore
from forge_rl.actors.replay_buffer_config import ReplayBufferConfig
from forge_rl.errors import ConfigError
from forge_rl.data.seeds import REQUEST_SEED_BITS, request_seed
from tests.unit.loop.test_admission import make_group


def test_request_seed_is_a_function_of_run_seed_example_and_draw():
    seed = request_seed(7, "train-7-3", 12)
    assert seed == request_seed(7, "train-7-3", 12)  # same inputs, same seed: in another process too (no hash())
    others = {request_seed(8, "train-7-3", 12), request_seed(7, "train-7-4", 12), request_seed(7, "train-7-3", 13)}
    assert seed not in others and len(others) == 3
    # room for vLLM's seed + i of each sample of a group, in a 64-bit generator seed
    draws = [request_seed(0, f"id-{i}", i) for i in range(2000)]
    assert all(0 <= s < 2**REQUEST_SEED_BITS for s in draws) and len(set(draws)) == len(draws)


def test_batch_order_does_not_depend_on_arrival_order():
    def batch(arrival: list[int]) -> torch.Tensor:
        store = GroupStore(ReplayBufferConfig(capacity=8), max_policy_age=0)
        for i in arrival:
            group = make_group(i, version=0, zero_advantage=False)
            group.episodes[0].completion.response_ids = torch.tensor([i, i])  # tell the groups apart in the batch
            store.add(group)
        return store.sample(0, batch_groups=4)[0].tokens

    arrivals = [[0, 1, 2, 3], [3, 1, 0, 2], [2, 3, 1, 0]]
    batches = [batch(a) for a in arrivals]
    assert all(torch.equal(batches[0], b) for b in batches[1:])


def test_random_order_draws_the_same_batch_whatever_the_arrival_order():
    def picked(arrival: list[int]) -> list[str]:
        store = GroupStore(ReplayBufferConfig(capacity=8, order="random"), max_policy_age=0, seed=3)
        for i in arrival:
            store.add(make_group(i, version=0, zero_advantage=False))
        return [e.group.prompt_id for e in store._order(store.entries)]

    arrival = list(range(6))
    shuffled = random.Random(1).sample(arrival, len(arrival))
    assert picked(arrival) == picked(shuffled)


def test_cpu_engine_prefill_is_never_chunked():
    args = unchunked_prefill({"max_model_len": 4096}, "generator.engine_args")
    assert args["enable_chunked_prefill"] is False and args["max_num_batched_tokens"] == 4096  # a whole prompt fits
    assert unchunked_prefill({"max_model_len": 128}, "k")["max_num_batched_tokens"] == 2048  # vLLM's own budget
    try:
        unchunked_prefill({"enable_chunked_prefill": True}, "generator.engine_args")
    except ConfigError as e:
        assert str(e).startswith("generator.engine_args.enable_chunked_prefill=true on a CPU engine")
    else:
        raise AssertionError("an explicit chunked prefill on a CPU engine was taken")
