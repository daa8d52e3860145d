"""Rollouts for group-based RL apps: staleness-aware admission, and one group from prompt to buffer.

Admission decides when a rollout may start. A group is worth generating only if it can still be trained
on within `max_policy_age` versions of the weights that generate it. With B groups per train step, groups
are trained in about the order they were admitted, so the k-th group waiting (in flight or buffered,
counted from the next batch) is trained at version `sample_version + k // B`. Its tokens come from the
generators' version `g` or newer. So the rule is

    pending < (max_policy_age + 1 - (sample_version - g)) * B

where `pending` = rollouts in flight + groups in the buffer, `sample_version` = the trainer version at
which the next batch will be sampled (one ahead while a step is running) and `g` = the version every
generator replica has loaded. With `max_policy_age: 0` this is the synchronous loop: exactly one batch is
generated with the current weights, nothing runs while the trainer steps and the generators swap. Nor is more
admitted than the run's remaining steps can train (`steps`): at the end of a run, a group generated beyond its
last batch would be work for nothing (in an asynchronous run of a few steps, up to a sixth of its generation).

Only a straggler that completes after groups admitted later can still arrive too old. What happens to it is
`stale_in_flight` (docs/replay_buffer.md): "finish" (the default) lets it run to its end, its later tokens made by
the newer weights the generators load meanwhile (each token keeps its version), and the buffer drops the group if
its oldest token is still too old when a batch is sampled (counted as stale); "requeue" aborts it in the engine as
soon as the generators load a version that no batch could train it at any more, and its prompt is generated again
from the start by the next rollout (counted in `RolloutStats.requeued_*`).

A group whose reward fails is dropped and counted under the failure's reason (reward_error, reward_timeout,
...). The first drop of each reason is printed in full; later ones are summarised per reason every
DROP_SUMMARY_S (`DropLog`), never a line per group. A reward that fails on each of the first FAIL_FAST_GROUPS
groups it is given, before it has ever scored one, stops the run (`RewardFailing`) with its own error and a
sample input: it would train nothing. A dead reward role (the reward actor, a reward model, a judge) stops
the run too, named.
"""

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from forge_rl.actors.dataset import PromptDataset
from forge_rl.actors.replay_buffer import ReplayBuffer
from forge_rl.actors.reward import RewardActor, RewardRoleDied
from forge_rl.data.vision import image_args
from forge_rl.deps.monarch import SupervisionError
from forge_rl.errors import RunStopped
from forge_rl.runtime.replies import replies
from forge_rl.loop.lengths import LengthDraws
from forge_rl.losses.advantages import group_advantages
from forge_rl.observability.timeline import phase
from forge_rl.rewards.overlong import OverlongConfig, overlong_penalty
from forge_rl.rewards.workers import RewardError
from forge_rl.types import Episode, Group

FAIL_FAST_GROUPS = 8  # a reward that fails on each of its first 8 groups, never scoring one, stops the run
# a group with a sample whose kept set (truncated sampling) exceeded generator.max_kept_tokens (episodes)
KEPT_OVER_CAP = "sampling_mask_over_cap"
DROP_SUMMARY_S = 30.0  # repeated drops: one line per interval, each reason counted


class RewardFailing(RunStopped):
    """A reward failed on every one of its first FAIL_FAST_GROUPS groups: the run stops with its error."""


class DropLog:
    """Dropped groups on the console without flooding it: the first of each reason in full, then per reason
    a count and the latest message, at most once every `interval_s`."""

    def __init__(self, interval_s: float = DROP_SUMMARY_S, write=None):
        self.interval_s = interval_s
        self.write = write or (lambda line: print(line, flush=True))
        self.seen: set[str] = set()
        self.pending: dict[str, int] = {}
        self.latest: dict[str, str] = {}
        self.last_summary = time.monotonic()

    def dropped(self, group_id: str, reason: str, message: str) -> None:
        message = message.strip().splitlines()[0][:200] if message.strip() else "no message"
        if reason not in self.seen:
            self.seen.add(reason)
            if not self.pending:  # the next summary counts from here, not from the start of the run
                self.last_summary = time.monotonic()
            self.write(
                f"dropped group {group_id} ({reason}): {message} (further {reason} drops are counted, "
                f"summarised every {self.interval_s:.0f} s)"
            )
            return
        self.pending[reason] = self.pending.get(reason, 0) + 1
        self.latest[reason] = message
        if time.monotonic() - self.last_summary >= self.interval_s:
            self.flush()

    def flush(self) -> None:
        """Print the drops counted since the last summary, if any."""
        now = time.monotonic()
        if self.pending:
            counts = "; ".join(f"{reason} {n} (latest: {self.latest[reason]})" for reason, n in self.pending.items())
            self.write(f"dropped groups in the last {now - self.last_summary:.0f} s: {counts}")
        self.pending, self.last_summary = {}, now


class Admission:
    """Counts pending groups and admits a rollout only while it can be trained within max_policy_age."""

    def __init__(self, max_policy_age: int, batch_groups: int, version: int = 0, steps: int | None = None):
        if max_policy_age < 0 or batch_groups < 1:
            raise ValueError(
                f"Admission: max_policy_age={max_policy_age} must be >= 0 and batch_groups={batch_groups} >= 1"
            )
        self.max_policy_age, self.batch_groups = max_policy_age, batch_groups
        self.steps = steps  # the run's last step: no more groups are admitted than the steps left can train
        self.sample_version = version  # trainer version at the next sample
        self.generator_version = version  # the version every generator replica has loaded
        self.in_flight = 0
        self.buffered = 0
        self.admitted = 0
        self.stored = 0  # rollouts that ended with their group in the buffer, ever
        self.wait_s = 0.0  # rollout time spent waiting for admission
        self.paused = False  # set while the app evaluates: no new rollouts (fair, untimed evaluations)
        self._changed = asyncio.Condition()

    @property
    def capacity(self) -> int:
        lag = self.sample_version - self.generator_version
        capacity = (self.max_policy_age + 1 - lag) * self.batch_groups
        if self.steps is not None:  # groups the run's remaining batches can take; more would never be trained
            capacity = min(capacity, (self.steps - self.sample_version) * self.batch_groups)
        return max(0, capacity)

    @property
    def pending(self) -> int:
        return self.in_flight + self.buffered

    def can_admit(self) -> bool:
        return not self.paused and self.pending < self.capacity

    async def pause(self, paused: bool = True) -> None:
        """Stop (or, with False, resume) admitting rollouts; those in flight finish."""
        async with self._changed:
            self.paused = paused
            self._changed.notify_all()

    async def quiesce(self, timeout_s: float) -> bool:
        """Pause admission and wait until no rollout is in flight: every group started is in the buffer (or
        dropped and counted), and nothing holds a prompt that the data position has already passed, so a
        checkpoint taken now is consistent. False if rollouts were still in flight after `timeout_s` (one
        blocked adding to a full buffer waits for the trainer). `pause(False)` resumes admission."""
        async with self._changed:
            self.paused = True
            self._changed.notify_all()
            try:
                await asyncio.wait_for(self._changed.wait_for(lambda: self.in_flight == 0), timeout_s)
            except TimeoutError:
                return False
        return True

    async def acquire(self) -> int:
        """Wait until a rollout may start; returns the generator version it is admitted under."""
        start = time.perf_counter()
        async with self._changed:
            await self._changed.wait_for(self.can_admit)
            self.in_flight += 1
            self.admitted += 1
        self.wait_s += time.perf_counter() - start
        return self.generator_version

    async def finish(self, stored: bool) -> None:
        """A rollout ended: its group is in the buffer (`stored`), or it was dropped or failed."""
        async with self._changed:
            self.in_flight -= 1
            self.buffered += int(stored)
            self.stored += int(stored)
            self._changed.notify_all()

    async def sampled(self, buffered_groups: int, sample_version: int, stored_before_read: int | None = None) -> None:
        """The trainer took a batch: `buffered_groups` are left in the buffer, the next sample is at
        `sample_version`. See `buffer_holds` for `stored_before_read`."""
        async with self._changed:
            self.buffered, self.sample_version = self._count(buffered_groups, stored_before_read), sample_version
            self._changed.notify_all()

    async def buffer_holds(self, buffered_groups: int, stored_before_read: int | None = None) -> None:
        """The buffer's own count of groups. A sample that finds too few groups may still have dropped stale
        ones; without this, admission would keep counting them and could wait forever.

        The count is read from the buffer actor while rollouts go on finishing: pass `stored_before_read`
        (`self.stored` taken before the read), so that groups stored after it are added rather than lost.
        Lost, they would free slots that are not free and admit groups beyond the bound, which then arrive
        stale. (A group stored just before the read may be counted twice until the next count: admission
        is then briefly stricter, never looser.)"""
        async with self._changed:
            self.buffered = self._count(buffered_groups, stored_before_read)
            self._changed.notify_all()

    def _count(self, buffered_groups: int, stored_before_read: int | None) -> int:
        return buffered_groups + (0 if stored_before_read is None else self.stored - stored_before_read)

    async def generators_at(self, version: int) -> None:
        """Every generator replica now runs `version`."""
        async with self._changed:
            self.generator_version = version
            self._changed.notify_all()


@dataclass
class RolloutStats:
    """What the rollouts did since the last train step (reset by the train loop) and in total."""

    rewards: list[float] = field(default_factory=list)
    parts: dict[str, list[float]] = field(default_factory=dict)
    generated_tokens: int = 0
    # reward_* (forge_rl/rewards/workers.py) count episodes; prompt_too_long counts prompts the engine refused;
    # a multi-turn run adds env_error and generation_error, in episodes (forge_rl/loop/multiturn.py); truncated
    # sampling adds sampling_mask_over_cap, in episodes (KEPT_OVER_CAP)
    drops: dict[str, int] = field(
        default_factory=lambda: {
            "reward_error": 0,
            "reward_timeout": 0,
            "reward_crash": 0,
            "reward_memory": 0,
            "prompt_too_long": 0,
        }
    )
    drop_log: DropLog = field(default_factory=DropLog)
    rewards_working: set[str] = field(default_factory=set)  # rewards that have scored a group, ever
    reward_failures: dict[str, int] = field(default_factory=dict)  # groups each reward failed on, ever
    # partial rollouts, ever: sequences generated, those that saw a weight swap mid-way, and their tokens made by
    # a newer version than the one that made the sequence's first token
    sequences: int = 0
    swapped_sequences: int = 0
    swapped_tokens: int = 0
    # stale_in_flight "requeue": groups aborted in the engine as too old, the tokens they had made, and the
    # examples waiting to be generated again (taken before the dataset's next)
    requeued_groups: int = 0
    requeued_tokens: int = 0
    requeue: list = field(default_factory=list)

    def count_versions(self, completions) -> None:
        """Count the completions' tokens made under a newer version than their sequence's first token."""
        for c in completions:
            v = c.policy_versions
            self.sequences += 1
            if len(v) and int(v.max()) > int(v[0]):
                self.swapped_sequences += 1
                self.swapped_tokens += int((v > v[0]).sum())

    def partial_rollouts(self) -> dict[str, int]:
        return dict(
            sequences=self.sequences,
            swapped_sequences=self.swapped_sequences,
            swapped_tokens=self.swapped_tokens,
            requeued_groups=self.requeued_groups,
            requeued_tokens=self.requeued_tokens,
        )

    def reward_failed(self, prompt_id: str, failure: Exception, episodes: int) -> None:
        """Count and log a group dropped for `failure`; raises RewardFailing when the reward that failed has
        failed on each of its first FAIL_FAST_GROUPS groups."""
        reason = failure.reason if isinstance(failure, RewardError) else "reward_error"
        self.drops[reason] = self.drops.get(reason, 0) + episodes
        self.drop_log.dropped(prompt_id, reason, str(failure))
        name = getattr(failure, "reward", None)
        if name is None or name in self.rewards_working:
            return
        self.reward_failures[name] = self.reward_failures.get(name, 0) + 1
        if self.reward_failures[name] >= FAIL_FAST_GROUPS:
            first_line = str(failure).strip().splitlines()[0][:300] if str(failure).strip() else type(failure).__name__
            raise RewardFailing(
                f"reward {name!r} failed on each of the first {FAIL_FAST_GROUPS} groups it scored ({reason}), so the "
                f"run stops: {first_line}; a sample input: {getattr(failure, 'sample', 'not recorded')}"
            )

    def take_rewards(self) -> tuple[list[float], dict[str, list[float]]]:
        rewards, parts = self.rewards, self.parts
        self.rewards, self.parts = [], {}
        return rewards, parts


async def rollout_group(
    *,
    prompt_id: str,
    prompt,
    generator,
    score,
    group_size: int,
    stats: RolloutStats,
    scale_advantages_by_std: bool = True,
    metadata=None,
    overlong: OverlongConfig | None = None,
    max_tokens: int = 0,
    generate_args: dict | None = None,
) -> Group | None:
    """Generate a group of `group_size` completions of `prompt`, score it and compute group advantages.

    `score(completions) -> (totals, parts)` is awaited once per group. `overlong` (with the sampling's
    `max_tokens`) adds DAPO's length penalty to the totals and/or zeroes the advantage of truncated
    completions. `generate_args`: the generate call's own (a drawn length, max_age). Returns None (counted in
    `stats.drops`) when scoring fails; any other error propagates and ends the caller's loop.
    """
    with phase("generate"):
        completions = await generator.generate.route(prompt, n=group_size, **(generate_args or {}))
    stats.generated_tokens += sum(len(c.response_ids) for c in completions)
    stats.count_versions(completions)
    if over := sum(c.kept_over_cap > 0 for c in completions):  # the group is trained whole or not at all
        stats.drops[KEPT_OVER_CAP] = stats.drops.get(KEPT_OVER_CAP, 0) + len(completions)
        stats.drop_log.dropped(
            prompt_id,
            KEPT_OVER_CAP,
            f"{over} of its {len(completions)} samples drew a token from "
            "more tokens than the generator records (generator.max_kept_tokens), so the trainer "
            "could not reproduce them",
        )
        return None
    try:
        with phase("reward"):
            totals, parts = await score(completions)
    except SupervisionError:
        raise  # the reward actor died: the run's to handle (RoleDied), not one group's
    except Exception as e:  # a reward function failed on this group: drop it, count it, go on
        failure = getattr(e, "exception", e)  # what the reward actor raised
        if isinstance(failure, RewardRoleDied):  # a reward model's actor died: so will every later group
            raise failure from None
        stats.reward_failed(prompt_id, failure, len(completions))
        return None
    stats.rewards_working.update(parts)
    if overlong is not None and overlong.penalty_cache_len:
        penalties = [overlong_penalty(len(c.response_ids), max_tokens, overlong.penalty_cache_len) for c in completions]
        totals = [t + p for t, p in zip(totals, penalties)]
        parts = {**parts, "overlong": penalties}
    stats.rewards += totals
    for name, values in parts.items():
        stats.parts.setdefault(name, []).extend(values)
    advantages = group_advantages(totals, scale_by_std=scale_advantages_by_std)
    if overlong is not None and overlong.filter:  # truncated: no gradient, whatever their reward
        advantages = [0.0 if c.finish_reason == "length" else a for c, a in zip(completions, advantages)]
    episodes = [
        Episode(c, reward=t, rewards={k: v[i] for k, v in parts.items()}, advantage=a, metadata=dict(metadata or {}))
        for i, (c, t, a) in enumerate(zip(completions, totals, advantages))
    ]
    return Group(prompt_id, episodes)


async def rollout_loop(admission: Admission, stop: asyncio.Event, rollout_once: Callable[[], Awaitable[bool]]) -> None:
    """Start a rollout whenever admission allows one, until `stop` is set. `rollout_once()` produces one
    group and returns whether it reached the buffer; an error in it ends this loop (and so the run)."""
    while not stop.is_set():
        await admission.acquire()
        stored = False
        try:
            stored = await rollout_once()
        finally:
            await admission.finish(stored)


async def rollout_from_dataset(
    *,
    dataset,
    generator,
    reward,
    buffer,
    group_size: int,
    stats: RolloutStats,
    scale_advantages_by_std: bool = True,
    overlong: OverlongConfig | None = None,
    max_tokens: int = 0,
    lengths: LengthDraws | None = None,
    max_age: int | None = None,
) -> bool:
    """One group of a task: the dataset actor's next example (`forge_rl.actors.dataset.PromptDataset`), G
    completions, the reward actor's scores with the example's columns, advantages, the buffer. True if stored.
    A prompt the engine refuses as too long is counted (drops["prompt_too_long"]) and skipped. `lengths`: the
    group's response length is drawn (forge_rl/loop/lengths.py). `max_age` (stale_in_flight "requeue"): a group
    the generators abort as too old is counted and its example queued to be generated again. An example with
    images (task.image_column) is sampled with them, and its completions keep them (`Completion.images`)."""
    from forge_rl.actors.generator import PromptTooLong, SequenceTooOld

    calls = replies()  # not call_one: Monarch never frees a call_one's reply port (runtime/replies.py)
    example = stats.requeue.pop(0) if stats.requeue else await calls.call(dataset, PromptDataset.next)

    async def score(completions):
        n = len(completions)
        return await calls.call(
            reward,
            RewardActor.score,
            [example.prompt] * n,
            [c.text for c in completions],
            [c.finish_reason for c in completions],
            {k: [v] * n for k, v in example.columns.items()},
        )

    generate_args = {
        **(lengths.sampling(example.id) if lengths is not None else {}),
        **({"max_age": max_age} if max_age is not None else {}),
        **({"seed": example.seed} if getattr(example, "seed", None) is not None else {}),  # the dataset's, per draw
        **image_args(example),  # the row's images (task.image_column): the group shares them, one engine request
    }
    try:
        group = await rollout_group(
            prompt_id=example.id,
            prompt=example.text,
            generator=generator,
            score=score,
            group_size=group_size,
            stats=stats,
            scale_advantages_by_std=scale_advantages_by_std,
            metadata={"example": example.id},
            overlong=overlong,
            max_tokens=max_tokens,
            generate_args=generate_args,
        )
    except Exception as e:
        failure = getattr(e, "exception", e)
        if isinstance(failure, SequenceTooOld):
            stats.requeued_groups += 1
            stats.requeued_tokens += failure.tokens
            stats.requeue.append(example)
            return False
        if not isinstance(failure, PromptTooLong):
            raise
        stats.drops["prompt_too_long"] += 1
        return False
    if group is None:
        return False
    with phase("buffer"):
        return await calls.call(buffer, ReplayBuffer.add, group)
