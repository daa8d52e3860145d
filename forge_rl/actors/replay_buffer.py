"""Replay buffer: whole groups between rollouts and training, bounded, with counted staleness drops.

`add(group)` waits while the buffer holds `capacity` groups (backpressure: capacity is what bounds how
far generation runs ahead). `sample(policy_version, batch_groups)` first drops every group holding an
episode whose oldest token came from a policy version u with policy_version - u > max_policy_age (every
episode of it counted as "stale"), then returns `batch_groups` whole groups as one TrainBatch per
data-parallel rank, or None when there are not enough yet.

Groups are kept or dropped whole because their advantages were computed over the whole group: trained
without some of its episodes, a group's advantages would no longer sum to zero, and the missing episodes'
baseline share would push every survivor's probability the same way (docs/replay_buffer.md). Every episode that
enters leaves as trained or as dropped with a reason, and
added == trained + dropped + present holds after every call.

The bookkeeping lives in `GroupStore` (plain Python, property-tested); the actor adds the waiting.
"""

import asyncio
import contextlib
import math
import numbers
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from monarch.actor import concurrent_endpoint, endpoint

from forge_rl.actors.replay_buffer_config import ReplayBufferConfig
from forge_rl.loop.sampling import untrainable
from forge_rl.runtime import ForgeActor
from forge_rl.types import Completion, Episode, Group, TrainBatch

DROP_REASONS = ("stale", "zero_advantage", "evicted")


@dataclass
class _Entry:
    group: Group
    uses: int = 0
    oldest: int = field(init=False)  # the oldest policy version of any of its tokens

    def __post_init__(self) -> None:
        self.oldest = min(e.oldest_version for e in self.group.episodes)


@dataclass
class GroupStore:
    """The buffer's groups and counts. `cfg` holds the user's settings; the rest is the run's: max_policy_age
    (top-level `max_policy_age`), dp_size (the trainer's data-parallel size), pad_id (the tokenizer's), seed and
    temperature (the trainer's: an episode sampled at another one, or with an option the trainer does not
    reproduce (forge_rl/loop/sampling.py), is refused at add; None: any temperature)."""

    cfg: ReplayBufferConfig
    max_policy_age: int = 1
    dp_size: int = 1
    pad_id: int = 0
    seed: int = 0
    temperature: float | None = None
    entries: list[_Entry] = field(default_factory=list)  # oldest first
    added: int = 0
    trained: int = 0
    dropped: Counter = field(default_factory=Counter)
    staleness: Counter = field(default_factory=Counter)  # policy_version - oldest_version of sampled episodes

    def __post_init__(self) -> None:
        if self.dp_size < 1:
            raise ValueError(f"the replay buffer's dp_size must be >= 1, got {self.dp_size}")
        if self.max_policy_age < 0:
            raise ValueError(f"max_policy_age must be >= 0, got {self.max_policy_age}")
        self.rng = random.Random(self.seed)

    @property
    def present(self) -> int:
        return sum(len(e.group) for e in self.entries)

    @property
    def full(self) -> bool:
        return len(self.entries) >= self.cfg.capacity

    def add(self, group: Group) -> bool:
        """Store `group` (the caller waits while full). Returns False when it was dropped on arrival."""
        validate_group(group)
        for i, ep in enumerate(group.episodes):  # whoever called the generator, with whatever overrides
            c = ep.completion
            if why := untrainable(c.sampling, self.temperature, c.kept_offsets is not None, c.kept_over_cap):
                raise ValueError(
                    f"group {group.prompt_id!r} episode {i} cannot be trained on: {why}. Only episodes of "
                    "the behaviour policy the trainer reproduces can be trained on (evaluate with any "
                    "sampling, but do not add those episodes to the buffer)"
                )
        self.added += len(group)
        if self.cfg.drop_zero_advantage and all(abs(e.advantage) < 1e-8 for e in group.episodes):
            self.dropped["zero_advantage"] += len(group)
            return False
        self.entries.append(_Entry(group))
        return True

    def drop_stale(self, policy_version: int) -> None:
        """Drop every group with an episode older than max_policy_age, whole (see the module doc)."""
        keep = []
        for entry in self.entries:
            if policy_version - entry.oldest <= self.max_policy_age:
                keep.append(entry)
            else:
                self.dropped["stale"] += len(entry.group)
        self.entries = keep

    def sample(self, policy_version: int, batch_groups: int) -> list[TrainBatch] | None:
        cfg = self.cfg
        if batch_groups < 1 or batch_groups % self.dp_size:
            raise ValueError(
                f"batch_groups={batch_groups} must be a positive multiple of the data-parallel size {self.dp_size} "
                "(groups are never split across ranks)"
            )
        if batch_groups > cfg.capacity:
            raise ValueError(f"batch_groups={batch_groups} exceeds buffer.capacity={cfg.capacity}")
        self.drop_stale(policy_version)
        fresh = [e for e in self.entries if e.uses == 0]
        reused = [e for e in self.entries if e.uses > 0]
        if len(fresh) < min(cfg.min_fresh_groups, batch_groups) or len(self.entries) < batch_groups:
            if self.full and reused:  # full of already-trained groups: retire the oldest so rollouts can go on
                self._retire([reused[0]])
            return None
        picked = self._order(fresh)[:batch_groups]
        picked += self._order(reused)[: batch_groups - len(picked)]
        for entry in picked:
            entry.uses += 1
            for ep in entry.group.episodes:
                self.staleness[policy_version - ep.oldest_version] += 1
        self._retire([e for e in picked if e.uses >= cfg.max_resample])
        per_rank = batch_groups // self.dp_size
        return [
            TrainBatch.collate(
                [ep for entry in picked[r * per_rank : (r + 1) * per_rank] for ep in entry.group.episodes],
                pad_id=self.pad_id,
            )
            for r in range(self.dp_size)
        ]

    def _order(self, entries: list[_Entry]) -> list[_Entry]:
        """ "oldest": the groups with the oldest tokens first, then by prompt id. A straggler (a long response
        started under an older version) that arrives after groups started later is trained first, before it is too
        old; in arrival order it would wait behind them and could be dropped as stale. Within a version the order is
        the prompt ids', not arrival's: concurrent rollouts finish in an order timing decides, and a seeded run must
        collate the same batch in the same order (a sum in another order differs in its last bits). "random" draws
        from that same order with the seeded rng."""
        ordered = sorted(entries, key=lambda e: (e.oldest, e.group.prompt_id))  # stable: arrival among equal ids
        if self.cfg.order == "random":
            return self.rng.sample(ordered, len(ordered))
        return ordered

    def _retire(self, entries: list[_Entry]) -> None:
        gone = {id(e) for e in entries}
        self.trained += sum(len(e.group) for e in entries)
        self.entries = [e for e in self.entries if id(e) not in gone]

    def evict_all(self) -> int:
        """At shutdown: whatever is still here leaves as dropped("evicted"). Returns the episode count."""
        n = self.present
        self.dropped["evicted"] += n
        self.entries = []
        return n

    def stats(self) -> dict:
        return dict(
            added=self.added,
            trained=self.trained,
            present=self.present,
            groups=len(self.entries),
            dropped={r: self.dropped[r] for r in DROP_REASONS},
            staleness=dict(sorted(self.staleness.items())),
        )

    def state_dict(self) -> dict:
        return dict(
            entries=[(e.group, e.uses) for e in self.entries],
            added=self.added,
            trained=self.trained,
            dropped=dict(self.dropped),
            staleness=dict(self.staleness),
            rng=self.rng.getstate(),
        )

    def load_state_dict(self, state: dict) -> None:
        self.entries = [_Entry(group, uses) for group, uses in state["entries"]]
        self.added, self.trained = state["added"], state["trained"]
        self.dropped, self.staleness = Counter(state["dropped"]), Counter(state["staleness"])
        self.rng.setstate(state["rng"])


def validate_group(group: Group) -> None:
    """Reject a malformed group before the buffer changes. Stored, it would fail (or train on garbage)
    only later, when a batch is collated from it together with good groups. Group() checks some of
    this on construction, but unpickling skips __init__, so everything is checked here. Whole-tensor
    checks per episode, no per-token loops."""
    if not isinstance(group, Group):
        raise TypeError(f"ReplayBuffer.add takes a Group, got {type(group).__name__}")
    if not group.episodes:
        raise ValueError(f"group {group.prompt_id!r} has no episodes")
    first = None
    for i, ep in enumerate(group.episodes):
        at = f"group {group.prompt_id!r} episode {i}"
        if not isinstance(ep, Episode) or not isinstance(ep.completion, Completion):
            got = type(ep.completion if isinstance(ep, Episode) else ep).__name__
            raise ValueError(f"{at}: expected an Episode holding a Completion, got {got}")
        c = ep.completion
        for name in ("prompt_ids", "response_ids", "logprobs", "policy_versions"):
            _check_1d(at, name, getattr(c, name))
        if len(c.prompt_ids) == 0:
            raise ValueError(f"{at}: completion.prompt_ids is empty; a response needs at least one prompt token")
        if (R := len(c.response_ids)) == 0:
            raise ValueError(f"{at}: completion.response_ids is empty (no response tokens to train on)")
        for name in ("logprobs", "policy_versions"):
            if (n := len(getattr(c, name))) != R:
                raise ValueError(f"{at}: completion.{name} has {n} entries, expected {R} (one per response token)")
        env_mask = getattr(c, "env_mask", None)  # multi-turn: the environment's tokens (no loss)
        if env_mask is not None:
            if not isinstance(env_mask, torch.Tensor) or env_mask.dtype != torch.bool or env_mask.shape != (R,):
                got = (
                    f"{env_mask.dtype} {tuple(env_mask.shape)}"
                    if isinstance(env_mask, torch.Tensor)
                    else type(env_mask).__name__
                )
                raise ValueError(f"{at}: completion.env_mask is {got}, expected a bool tensor of shape ({R},)")
            if env_mask.all():
                raise ValueError(
                    f"{at}: completion.env_mask marks every response token as the environment's "
                    "(no model token to train on)"
                )
        if first is None:
            first = c.prompt_ids
        elif not torch.equal(c.prompt_ids, first):
            raise ValueError(f"{at}: completion.prompt_ids differ from episode 0")
        if not (finite := torch.isfinite(c.logprobs)).all():
            where = int((~finite).nonzero()[0])
            raise ValueError(
                f"{at}: completion.logprobs has {c.logprobs[where].item()} at response token {where}, "
                "expected finite values"
            )
        if ep.advantage is None:
            raise ValueError(f"{at}: advantage is None (compute advantages first)")
        if not isinstance(ep.advantage, numbers.Real) or not math.isfinite(ep.advantage):
            raise ValueError(f"{at}: advantage is {ep.advantage!r}, expected a finite number")


def _check_1d(at: str, name: str, value) -> None:
    """Token ids and versions must be integers (collate would truncate floats into them silently),
    logprobs floating point."""
    want = "a floating-point" if name == "logprobs" else "an integer"
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{at}: completion.{name} is a {type(value).__name__}, expected {want} 1-D tensor")
    if value.dim() != 1:
        raise ValueError(f"{at}: completion.{name} has shape {tuple(value.shape)}, expected 1 dim")
    dtype = value.dtype
    if dtype.is_floating_point != (name == "logprobs") or dtype.is_complex or dtype == torch.bool:
        raise ValueError(f"{at}: completion.{name} has dtype {dtype}, expected {want} dtype")


class ReplayBuffer(ForgeActor):
    def __init__(self, cfg: ReplayBufferConfig | None = None, **run: Any):
        """`run`: GroupStore's settings that the run decides (max_policy_age, dp_size, pad_id, seed, temperature)."""
        self.store = GroupStore(cfg or ReplayBufferConfig(), **run)
        self.add_blocked_s = 0.0  # producers waiting for room
        self.sample_empty_s = 0.0  # consumer getting None: from the first None to the next batch
        self._empty_since: float | None = None
        self._room: asyncio.Condition | None = None
        self.waiting = {"adds": 0, "samples": 0}  # calls waiting now (for tests and a stuck run's diagnosis)

    def _condition(self) -> asyncio.Condition:
        if self._room is None:  # created on the actor's event loop, at first use
            self._room = asyncio.Condition()
        return self._room

    @concurrent_endpoint  # a blocked add must not keep sample() from running and freeing room
    async def add(self, group: Group) -> bool:
        validate_group(group)
        room = self._condition()
        async with room:
            if self.store.full:
                start = time.perf_counter()
                self.waiting["adds"] += 1
                try:
                    await room.wait_for(lambda: not self.store.full)
                finally:
                    self.waiting["adds"] -= 1
                self.add_blocked_s += time.perf_counter() - start
            stored = self.store.add(group)
            room.notify_all()  # a sample() waiting for groups looks again
            return stored

    @concurrent_endpoint  # it may wait for groups, and add() must run meanwhile
    async def sample(self, policy_version: int, batch_groups: int, wait_s: float = 0.0) -> list[TrainBatch] | None:
        """`batch_groups` groups trainable at `policy_version`, one TrainBatch per data-parallel rank; None when
        the buffer still has too few after waiting up to `wait_s`. Each add wakes the wait, so the trainer
        gets its batch as soon as it exists without polling (every actor call costs the caller CPU, and
        memory in Monarch 0.7.0: docs/stack.md)."""
        room = self._condition()
        deadline = time.perf_counter() + wait_s
        async with room:
            while (batches := self.store.sample(policy_version, batch_groups)) is None:
                room.notify_all()  # stale drops free room
                if (remaining := deadline - time.perf_counter()) <= 0:
                    break
                self.waiting["samples"] += 1
                try:
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(room.wait(), remaining)
                finally:
                    self.waiting["samples"] -= 1
            room.notify_all()  # sampling and stale drops free room
        now = time.perf_counter()
        if batches is None:
            self._empty_since = self._empty_since or now
        elif self._empty_since is not None:
            self.sample_empty_s += now - self._empty_since
            self._empty_since = None
        return batches

    @endpoint
    async def evict(self) -> dict:
        """Empty the buffer at the end of a run (counted as dropped "evicted"); returns final stats."""
        room = self._condition()
        async with room:
            self.store.evict_all()
            room.notify_all()
        return await self._stats()

    @endpoint
    async def stats(self) -> dict:
        return await self._stats()

    async def _stats(self) -> dict:
        return dict(
            self.store.stats(),
            add_blocked_s=self.add_blocked_s,
            sample_empty_s=self.sample_empty_s,
            **{f"waiting_{k}": n for k, n in self.waiting.items()},
        )

    @endpoint
    async def state_dict(self) -> dict:
        return dict(self.store.state_dict(), add_blocked_s=self.add_blocked_s, sample_empty_s=self.sample_empty_s)

    @endpoint
    async def load_state_dict(self, state: dict) -> None:
        self.store.load_state_dict(state)
        self.add_blocked_s, self.sample_empty_s = state["add_blocked_s"], state["sample_empty_s"]
