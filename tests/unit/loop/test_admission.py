"""Staleness-aware admission (forge_rl.loop.rollout.Admission) against the real replay-buffer bookkeeping.

A simulated run drives Admission and GroupStore through random interleavings of rollouts finishing,
zero-advantage groups, train steps and slow generator weight swaps. Admission must never let a rollout
start whose group would be stale when it arrives, as long as groups arrive in the order they were
admitted; with arbitrary arrival order (stragglers) every stale episode is still counted.
"""

import asyncio
import random

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from forge_rl.actors.replay_buffer import GroupStore
from forge_rl.actors.replay_buffer_config import ReplayBufferConfig
from forge_rl.loop.rollout import Admission
from forge_rl.types import Completion, Episode, Group


def make_group(i: int, version: int, zero_advantage: bool, size: int = 2) -> Group:
    episodes = []
    for k in range(size):
        completion = Completion(
            prompt_ids=torch.tensor([1, 2]),
            response_ids=torch.tensor([3, 4]),
            logprobs=torch.tensor([-1.0, -1.0]),
            policy_versions=torch.tensor([version, version]),
            finish_reason="stop",
            text="",
        )
        advantage = 0.0 if zero_advantage else (1.0 if k == 0 else -1.0)
        episodes.append(Episode(completion, reward=advantage, advantage=advantage))
    return Group(f"p{i}", episodes)


def simulate(
    seed: int, max_policy_age: int, batch_groups: int, concurrency: int, in_order: bool, steps: int = 12
) -> GroupStore:
    """A run of `steps` train steps; returns the buffer's bookkeeping."""
    rng = random.Random(seed)

    async def run() -> GroupStore:
        adm = Admission(max_policy_age, batch_groups)
        store = GroupStore(ReplayBufferConfig(capacity=10_000), max_policy_age=max_policy_age)
        version, gen_version, swap_due = 0, 0, None  # swap_due: the version the generators load next
        in_flight: list[tuple[int, int]] = []  # (admission order, generator version when admitted)
        admitted = 0
        for _ in range(10_000):
            if version >= steps:
                break
            # rollouts start whenever admission allows, up to the concurrency limit
            while len(in_flight) < concurrency and adm.can_admit():
                in_flight.append((admitted, await adm.acquire()))
                admitted += 1
            event = rng.random()
            if in_flight and event < 0.5:  # a rollout completes (its tokens are from its admission version,
                # or newer when a swap happened meanwhile: the generator version now)
                pick = 0 if in_order else rng.randrange(len(in_flight))
                i, admitted_at = in_flight.pop(pick)
                tokens_version = rng.choice([admitted_at, gen_version])
                stored = store.add(make_group(i, tokens_version, zero_advantage=rng.random() < 0.3))
                await adm.finish(stored)
            elif event < 0.8 and swap_due is not None:  # the generators finish loading the newest weights
                gen_version, swap_due = swap_due, None
                await adm.generators_at(gen_version)
            elif swap_due is None:  # the trainer samples, steps, and publishes version + 1
                batch = store.sample(version, batch_groups)
                if batch is not None:
                    await adm.sampled(len(store.entries), version + 1)
                    version += 1
                    swap_due = version
                else:  # as the app's wait loop does: stale drops free room
                    await adm.buffer_holds(len(store.entries))
        assert version == steps, "the simulated run stalled: admission never let enough rollouts start"
        assert adm.pending <= (max_policy_age + 1) * batch_groups
        return store

    return asyncio.run(run())


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    max_policy_age=st.integers(0, 3),
    batch_groups=st.integers(1, 6),
    concurrency=st.integers(1, 12),
)
def test_no_rollout_is_admitted_that_would_arrive_stale(seed, max_policy_age, batch_groups, concurrency):
    store = simulate(seed, max_policy_age, batch_groups, concurrency, in_order=True)
    assert store.dropped["stale"] == 0
    assert all(age <= max_policy_age for age in store.staleness)
    assert store.added == store.trained + sum(store.dropped.values()) + store.present


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    max_policy_age=st.integers(0, 2),
    batch_groups=st.integers(1, 4),
    concurrency=st.integers(2, 12),
)
def test_stragglers_are_dropped_and_counted_never_trained_stale(seed, max_policy_age, batch_groups, concurrency):
    store = simulate(seed, max_policy_age, batch_groups, concurrency, in_order=False)
    assert all(age <= max_policy_age for age in store.staleness)  # what was trained met the bound
    assert store.added == store.trained + sum(store.dropped.values()) + store.present


def test_synchronous_admission_generates_one_batch_per_version():
    async def run():
        adm = Admission(max_policy_age=0, batch_groups=4)
        assert adm.capacity == 4
        for _ in range(4):
            await adm.acquire()
        assert not adm.can_admit()  # exactly one batch
        await adm.finish(stored=False)  # a zero-advantage group frees its slot for a top-up
        assert adm.can_admit()
        await adm.acquire()
        for _ in range(4):
            await adm.finish(stored=True)
        await adm.sampled(buffered_groups=0, sample_version=1)
        assert adm.capacity == 0  # nothing is generated while the trainer steps and the generators swap
        waiter = asyncio.ensure_future(adm.acquire())
        await asyncio.sleep(0)  # one turn of the loop runs the waiter up to its wait (nothing else suspends it)
        assert not waiter.done()
        await adm.generators_at(1)
        assert await asyncio.wait_for(waiter, 1) == 1  # admitted under the new weights

    asyncio.run(run())


def test_stale_groups_dropped_by_a_failed_sample_free_their_slots():
    """A resumed synchronous run finds stale leftovers in the buffer: the sample drops them and fails;
    admission must count what the buffer really holds, or it waits forever (seen before the fix)."""

    async def run():
        adm = Admission(max_policy_age=0, batch_groups=4, version=3)
        store = GroupStore(ReplayBufferConfig(capacity=8), max_policy_age=0)
        for i in range(4):  # restored from a checkpoint: one group made by version 2, three by version 3
            store.add(make_group(i, 2 if i == 0 else 3, zero_advantage=False))
        await adm.buffer_holds(len(store.entries))
        assert not adm.can_admit()
        assert store.sample(3, 4) is None and store.dropped["stale"] == 2
        await adm.buffer_holds(len(store.entries))
        assert adm.can_admit()  # one more group makes the batch

    asyncio.run(run())


def test_a_group_stored_while_the_buffer_is_counted_still_counts():
    """The buffer's count crosses an actor call while rollouts go on finishing. A group stored after the
    count was read must not be lost: losing it freed a slot that was not free, and in the synchronous
    83M benchmark that admitted groups beyond the batch which arrived stale a step later (seen before
    the fix: 11% of generated episodes dropped at max_policy_age 0)."""

    async def run():
        adm = Admission(max_policy_age=0, batch_groups=4)
        for _ in range(4):
            await adm.acquire()
        for _ in range(3):
            await adm.finish(stored=True)
        before = adm.stored
        counted = 3  # what the buffer actor reports...
        await adm.finish(stored=True)  # ...while the fourth group lands in it
        await adm.buffer_holds(counted, before)
        assert adm.buffered == 4 and not adm.can_admit()  # the batch is complete: admit nothing more
        before = adm.stored
        await adm.sampled(0, sample_version=1, stored_before_read=before)
        assert adm.buffered == 0 and adm.capacity == 0

    asyncio.run(run())


def test_no_more_is_admitted_than_the_remaining_steps_can_train():
    """A run of 3 steps of 4 groups: whatever max_policy_age allows, pending groups never exceed what the steps
    left can take (a group generated beyond the last batch would be work for nothing), and the last step's
    zero-advantage drops still free their slots."""

    async def body():
        adm = Admission(max_policy_age=2, batch_groups=4, steps=3)
        assert adm.capacity == 12
        await adm.sampled(buffered_groups=0, sample_version=2)  # steps 1 and 2 taken or running
        await adm.generators_at(2)
        assert adm.capacity == 4  # one batch left, where age 2 alone would allow 12
        for _ in range(4):
            await adm.acquire()
        assert not adm.can_admit()
        await adm.finish(stored=False)  # a zero-advantage group: dropped, so another may start
        assert adm.can_admit()
        await adm.sampled(buffered_groups=0, sample_version=3)
        assert adm.capacity == 0 and not adm.can_admit()
        assert Admission(max_policy_age=2, batch_groups=4).capacity == 12  # no steps given: no end

    asyncio.run(body())
