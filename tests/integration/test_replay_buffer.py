"""Replay buffer: staleness bound, accounting, whole groups (property tests), backpressure on a real actor."""

import asyncio
import time
import pickle

import pytest
import torch
from hypothesis import given, settings, strategies as st
from monarch.actor import ActorError

from forge_rl.actors.replay_buffer import GroupStore, ReplayBuffer
from forge_rl.actors.replay_buffer_config import ReplayBufferConfig
from forge_rl.runtime import provisioned
from forge_rl.types import Completion, Episode, Group
from tests.conftest import run


def make_group(pid: str, versions: list[int], advantages: list[float] | None = None) -> Group:
    # zero-mean, as group_advantages makes them (an odd group's middle episode gets 0)
    advantages = advantages or [i - (len(versions) - 1) / 2 for i in range(len(versions))]
    eps = []
    for v, a in zip(versions, advantages):
        c = Completion(
            torch.tensor([100 + int(pid[1:]) if pid[1:].isdigit() else 1, 2]),
            torch.tensor([3, 4]),
            torch.tensor([-1.0, -1.0]),
            torch.tensor([v, v + 1]),
            "stop",
        )
        eps.append(Episode(c, advantage=a, metadata={"prompt": pid}))
    return Group(pid, eps)


ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.lists(st.integers(0, 3), min_size=1, max_size=4), st.booleans()),
        st.tuples(st.just("sample"), st.integers(1, 3), st.integers(0, 2)),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(
    ops=ops,
    max_age=st.integers(0, 2),
    dp=st.sampled_from([1, 2]),
    order=st.sampled_from(["oldest", "random"]),
    resample=st.integers(1, 2),
    min_fresh=st.integers(0, 2),
)
def test_bound_accounting_and_whole_groups(ops, max_age, dp, order, resample, min_fresh):
    store = GroupStore(
        ReplayBufferConfig(capacity=8, order=order, max_resample=resample, min_fresh_groups=min_fresh),
        max_policy_age=max_age,
        dp_size=dp,
    )
    uses: dict[str, int] = {}
    sizes: dict[str, int] = {}
    version, n = 0, 0
    for op in ops:
        if op[0] == "add" and not store.full:
            offsets, zero = op[1], op[2]
            group = make_group(f"p{n}", [max(0, version - o) for o in offsets], [0.0] * len(offsets) if zero else None)
            sizes[group.prompt_id] = len(group)
            n += 1
            store.add(group)
        elif op[0] == "sample":
            version += op[2]
            batches = store.sample(version, op[1] * dp)
            if batches is not None:
                assert len(batches) == dp
                for b in batches:
                    oldest = b.policy_versions.masked_fill(~b.response_mask, 10**9).min(dim=1).values
                    assert (version - oldest <= max_age).all()
                    for prompt in {ep_prompt(b, i) for i in range(b.num_sequences)}:
                        uses[prompt] = uses.get(prompt, 0) + 1
                        rows = [i for i in range(b.num_sequences) if ep_prompt(b, i) == prompt]
                        # trained whole, so its advantages keep the zero mean they were computed with
                        assert len(rows) == sizes[prompt]
                        assert abs(float(b.advantages[rows].sum())) < 1e-6
                assert max(uses.values()) <= resample  # never trained more often than configured
        assert store.added == store.trained + sum(store.dropped.values()) + store.present
        for entry in store.entries:  # stored groups stay whole: one prompt, no foreign episodes
            assert {ep.metadata["prompt"] for ep in entry.group.episodes} == {entry.group.prompt_id}


def ep_prompt(batch, i: int) -> str:
    """make_group encodes the group's number in the prompt's first token."""
    return f"p{int(batch.tokens[i, 0]) - 100}"


def test_sampled_batches_keep_groups_together_and_split_evenly():
    store = GroupStore(ReplayBufferConfig(capacity=8), dp_size=2)
    for i in range(4):
        store.add(make_group(f"p{i}", [0, 0, 0]))
    batches = store.sample(0, 4)
    assert [b.num_sequences for b in batches] == [6, 6]
    assert store.trained == 12 and store.present == 0


def test_stale_and_zero_advantage_drops_are_counted():
    store = GroupStore(ReplayBufferConfig(capacity=8), max_policy_age=1)
    store.add(make_group("old", [0, 3]))
    store.add(make_group("new", [2, 3]))
    assert store.add(make_group("flat", [3, 3], [0.0, 0.0])) is False
    # the episode from version 0 is too old at 3, so its whole group goes (its advantages need both episodes)
    (batch,) = store.sample(3, 1)
    assert batch.num_sequences == 2 and batch.policy_versions[batch.response_mask].min() == 2  # "new", whole
    assert store.dropped["stale"] == 2 and store.dropped["zero_advantage"] == 2 and store.present == 0


def test_bad_input_names_the_field():
    store = GroupStore(ReplayBufferConfig(capacity=2))
    with pytest.raises(ValueError, match="episode 0: advantage is None"):
        store.add(make_group("p", [0], [None]))
    with pytest.raises(ValueError, match="exceeds buffer.capacity=2"):
        store.sample(0, 3)
    with pytest.raises(ValueError, match="buffer.order="):
        ReplayBufferConfig(order="newest")


async def until_waiting(buf, kind: str, n: int = 1, timeout_s: float = 30) -> dict:
    """Poll the buffer's stats until `n` calls of `kind` ("adds", "samples") wait inside it; its stats then."""
    deadline = time.monotonic() + timeout_s
    while (stats := await buf.stats.call_one())[f"waiting_{kind}"] != n:
        assert time.monotonic() < deadline, f"{n} {kind} not waiting after {timeout_s} s: {stats}"
        await asyncio.sleep(0.01)
    return stats


def test_add_blocks_at_capacity_until_sampled():
    async def body():
        async with provisioned():
            buf = await ReplayBuffer.as_actor(ReplayBufferConfig(capacity=2))
            await buf.add.call_one(make_group("a", [0, 0]))
            await buf.add.call_one(make_group("b", [0, 0]))
            blocked = asyncio.ensure_future(buf.add.call_one(make_group("c", [0, 0])))
            assert (await until_waiting(buf, "adds"))["groups"] == 2  # it waits inside the full buffer, not stored
            assert not blocked.done()
            assert (await buf.sample.call_one(0, 1))[0].num_sequences == 2
            assert await asyncio.wait_for(blocked, 10) is True
            stats = await buf.stats.call_one()
            assert stats["add_blocked_s"] > 0 and stats["waiting_adds"] == 0
            assert stats["groups"] == 2 and stats["trained"] == 2
            assert await buf.sample.call_one(0, 2) is not None
            empty_at = time.perf_counter()
            assert await buf.sample.call_one(0, 1) is None
            await buf.add.call_one(make_group("d", [0, 0]))
            assert (await buf.sample.call_one(0, 1)) is not None
            state = await buf.state_dict.call_one()
            final = await buf.evict.call_one()
            assert 0 < final["sample_empty_s"] < time.perf_counter() - empty_at  # from the None to the batch
            assert final["added"] == final["trained"] + sum(final["dropped"].values()) == 8
            restored = await ReplayBuffer.as_actor(ReplayBufferConfig(capacity=2))
            await restored.load_state_dict.call_one(state)
            assert (await restored.stats.call_one())["trained"] == 8

    run(body())


def test_groups_in_a_batch_stay_whole_and_in_order():
    store = GroupStore(ReplayBufferConfig(capacity=8), dp_size=2)
    for i in range(4):
        store.add(make_group(f"p{i}", [0, 0, 0]))
    b0, b1 = store.sample(0, 4)
    assert [ep_prompt(b0, i) for i in range(6)] == ["p0"] * 3 + ["p1"] * 3
    assert [ep_prompt(b1, i) for i in range(6)] == ["p2"] * 3 + ["p3"] * 3


def test_a_straggler_that_arrives_late_is_trained_before_groups_started_after_it():
    """order "oldest": the group whose tokens are oldest goes first, so a long response started under version 0
    that arrives after version-1 groups is trained at version 1 instead of being dropped as stale at version 2."""
    store = GroupStore(ReplayBufferConfig(capacity=8), max_policy_age=1)
    for i in range(3):
        store.add(make_group(f"p{i}", [1, 1]))
    store.add(make_group("p9", [0, 1]))  # the straggler
    store.add(make_group("p3", [1, 1]))
    (b,) = store.sample(1, 2)
    assert [ep_prompt(b, i) for i in (0, 2)] == ["p9", "p0"]
    (b,) = store.sample(2, 3)
    assert [ep_prompt(b, i) for i in (0, 2, 4)] == ["p1", "p2", "p3"] and store.dropped["stale"] == 0


def test_random_order_split_is_deterministic_given_seed():
    def split(seed):
        store = GroupStore(ReplayBufferConfig(capacity=16, order="random"), dp_size=2, seed=seed)
        for i in range(12):
            store.add(make_group(f"p{i}", [0, 0]))
        return [[ep_prompt(b, i) for i in range(b.num_sequences)] for b in store.sample(0, 8)]

    assert split(1) == split(1)
    assert split(1) != split(2)
    assert [len(rank) for rank in split(1)] == [8, 8]


def test_resample_prefers_fresh_groups_and_retires_after_max_uses():
    store = GroupStore(ReplayBufferConfig(capacity=4, max_resample=2, min_fresh_groups=1))
    store.add(make_group("p0", [0, 0]))
    store.add(make_group("p1", [0, 0]))
    assert [ep_prompt(b, 0) for b in store.sample(0, 1)] == ["p0"]
    assert [ep_prompt(b, 0) for b in store.sample(0, 1)] == ["p1"]  # fresh before reused
    assert store.sample(0, 1) is None  # only reused groups left, min_fresh_groups=1
    store.add(make_group("p2", [0, 0]))
    batch = store.sample(0, 2)[0]
    assert [ep_prompt(batch, i) for i in (0, 2)] == ["p2", "p0"]
    assert store.trained == 2 and store.present == 4  # p0 used twice -> trained; p1, p2 may come back once


def test_state_dict_round_trip_continues_identically():
    cfg = ReplayBufferConfig(capacity=8, order="random", max_resample=2, min_fresh_groups=0)
    a = GroupStore(cfg)
    for i in range(6):
        a.add(make_group(f"p{i}", [1, 1]))
    a.sample(1, 2)
    b = GroupStore(cfg)
    b.load_state_dict(pickle.loads(pickle.dumps(a.state_dict())))
    assert b.stats() == a.stats()
    ta, tb = a.sample(2, 3), b.sample(2, 3)
    assert torch.equal(ta[0].tokens, tb[0].tokens)


def test_evict_counts_what_is_left():
    store = GroupStore(ReplayBufferConfig(capacity=4))
    store.add(make_group("p0", [0, 0, 0]))
    assert store.evict_all() == 3
    assert store.dropped["evicted"] == 3 and store.added == store.trained + sum(store.dropped.values())


def test_mixed_prompt_group_rejected_even_after_unpickling():
    group = make_group("p0", [0, 0])
    group.episodes[1].completion.prompt_ids = torch.tensor([9, 9])  # as a hand-built or unpickled group could be
    with pytest.raises(ValueError, match="episode 1: completion.prompt_ids differ"):
        GroupStore(ReplayBufferConfig()).add(group)
    with pytest.raises(ValueError, match="episode 0: advantage is nan, expected a finite number"):
        GroupStore(ReplayBufferConfig()).add(make_group("p1", [0], [float("nan")]))


def _completion(**fields):
    """Set fields of episode 1's completion after the group was built (as unpickled data can be)."""

    def change(group: Group) -> None:
        for name, value in fields.items():
            setattr(group.episodes[1].completion, name, value)

    return change


def _episode(**fields):
    def change(group: Group) -> None:
        for name, value in fields.items():
            setattr(group.episodes[1], name, value)

    return change


def _no_prompt(group: Group) -> None:
    for ep in group.episodes:
        ep.completion.prompt_ids = torch.tensor([], dtype=torch.long)


def _completion_for_episode(group: Group) -> None:
    group.episodes[1] = group.episodes[1].completion


# (a change to a 2-episode group "bad" with 2-token prompts and responses, what the error must say)
MALFORMED_GROUPS = {
    "short logprobs": (
        _completion(logprobs=torch.tensor([-1.0])),
        r"group 'bad' episode 1: completion.logprobs has 1 entries, expected 2 "
        r"\(one per response token\)",
    ),
    "no versions": (
        _completion(policy_versions=torch.tensor([], dtype=torch.long)),
        r"episode 1: completion.policy_versions has 0 entries, expected 2",
    ),
    "float ids": (
        _completion(response_ids=torch.tensor([3.0, 4.0])),
        r"episode 1: completion.response_ids has dtype torch.float32, expected an integer dtype",
    ),
    "bool versions": (
        _completion(policy_versions=torch.tensor([True, False])),
        r"episode 1: completion.policy_versions has dtype torch.bool, expected an integer dtype",
    ),
    "int logprobs": (
        _completion(logprobs=torch.tensor([-1, -1])),
        r"episode 1: completion.logprobs has dtype torch.int64, expected a floating-point dtype",
    ),
    "2-D prompt": (
        _completion(prompt_ids=torch.tensor([[1, 2]])),
        r"episode 1: completion.prompt_ids has shape \(1, 2\), expected 1 dim",
    ),
    "list ids": (
        _completion(response_ids=[3, 4]),
        r"episode 1: completion.response_ids is a list, expected an integer 1-D tensor",
    ),
    "no response": (
        _completion(
            response_ids=torch.tensor([], dtype=torch.long),
            logprobs=torch.tensor([]),
            policy_versions=torch.tensor([], dtype=torch.long),
        ),
        r"episode 1: completion.response_ids is empty",
    ),
    "no prompt": (_no_prompt, r"episode 0: completion.prompt_ids is empty"),
    "other prompt": (_completion(prompt_ids=torch.tensor([9, 9])), r"episode 1: completion.prompt_ids differ"),
    "-inf logprob": (
        _completion(logprobs=torch.tensor([-1.0, -float("inf")])),
        r"episode 1: completion.logprobs has -inf at response token 1, expected finite values",
    ),
    "inf advantage": (_episode(advantage=float("inf")), r"episode 1: advantage is inf, expected a finite number"),
    "text advantage": (_episode(advantage="0.5"), r"episode 1: advantage is '0.5', expected a finite number"),
    "no episode": (_completion_for_episode, r"episode 1: expected an Episode holding a Completion, got Completion"),
}


@pytest.mark.parametrize("case", MALFORMED_GROUPS)
def test_a_malformed_group_is_refused_by_name_and_the_buffer_is_unchanged(case):
    """Refused at add, not when a later batch is collated from it together with good groups."""
    change, message = MALFORMED_GROUPS[case]
    store = GroupStore(ReplayBufferConfig(capacity=4))
    store.add(make_group("p1", [0, 0]))
    before = pickle.dumps(store.state_dict())
    bad = make_group("bad", [0, 0])
    change(bad)
    with pytest.raises(ValueError, match=message):
        store.add(bad)
    assert pickle.dumps(store.state_dict()) == before
    assert store.added == 2 and ep_prompt(store.sample(0, 1)[0], 0) == "p1"


def test_the_actor_refuses_a_malformed_group_and_goes_on():
    async def body():
        async with provisioned():
            buf = await ReplayBuffer.as_actor(ReplayBufferConfig(capacity=2))
            bad = make_group("bad", [0, 0])
            MALFORMED_GROUPS["short logprobs"][0](bad)
            with pytest.raises(ActorError, match="episode 1: completion.logprobs has 1 entries, expected 2"):
                await buf.add.call_one(bad)
            assert await buf.add.call_one(make_group("p1", [0, 0])) is True
            assert (await buf.stats.call_one())["added"] == 2
            assert (await buf.sample.call_one(0, 1))[0].num_sequences == 2

    run(body())


def test_sample_waits_for_the_batch_and_wakes_on_add():
    """sample(wait_s) returns as soon as an add completes the batch, and None after wait_s without one."""

    async def body():
        async with provisioned():
            buf = await ReplayBuffer.as_actor(ReplayBufferConfig(capacity=4))
            start = time.perf_counter()
            assert await buf.sample.call_one(0, 1, wait_s=0.3) is None
            assert time.perf_counter() - start >= 0.3
            waiting = asyncio.ensure_future(buf.sample.call_one(0, 1, wait_s=30))
            await until_waiting(buf, "samples")  # inside the buffer, waiting for groups
            assert not waiting.done()
            added = time.perf_counter()
            await buf.add.call_one(make_group("a", [0, 0]))
            batches = await asyncio.wait_for(waiting, 10)
            assert batches[0].num_sequences == 2 and time.perf_counter() - added < 5  # woken, not timed out
            assert (await buf.stats.call_one())["trained"] == 2

    asyncio.run(body())
