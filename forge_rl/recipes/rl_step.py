"""One RL step, read top to bottom: collect -> score -> Trainer.step (train + publish) -> train beside -> swap.

    line = await rl_step(roles, state, algorithm)   # roles: Roles; state: StepState; algorithm: GRPO, PPO, ...

`train` (forge_rl/recipes/train.py) calls it once per step; a notebook calls it through `RLRun.rl_step()`. The
path from the app to the optimizer is main -> train -> rl_step -> Trainer.step -> optimizer.step() (and the
weight store's writer for the publish): four hops, each one call. The rollout tasks generate, score and buffer
groups beside every step (forge_rl/loop/rollout_tasks.py); the generators swap to each new version between their
engine steps while the next step collects (forge_rl/loop/weight_sync.py).
"""

import asyncio
import time

from forge_rl.loop.train_loop import batch_staleness, wait_for_batch
from forge_rl.observability.step_time import StepClock
from forge_rl.recipes.grpo_report import step_line
from forge_rl.recipes.roles import Roles
from forge_rl.recipes.step_state import StepState
from forge_rl.runtime.interrupt_safe import InterruptSafe
from forge_rl.runtime.timeouts import within


async def rl_step(roles: Roles, state: StepState, algorithm) -> dict[str, float]:
    """Collect a batch at the policy version, score it, train on it and publish version + 1, train what trains
    beside, swap the generators to the new version; `algorithm` (an Algorithm, forge_rl/recipes/algorithm.py)
    scores and trains beside. Returns the step's metrics line, also logged, with where the step's wall time went on
    its critical path (step_time/<part>, forge_rl/observability/step_time.py)."""
    s, cfg, version = state.shared, state.cfg, state.version + 1
    clock = StepClock(state.timeline, step=version)
    step_start, tokens_before = time.perf_counter(), s.rollouts.generated_tokens
    # 1. collect: a batch of groups at the trainer's version, from the replay buffer
    buffer_before = state.buffer_stats or await roles.buffer.stats.call_one()
    batches, sample_wait, staleness = await _collect(roles, state, clock, buffer_before)
    hold_s = await _step_aside(state, clock)  # a colocated trainer's device: the generators sleep
    busy_start = time.perf_counter()
    with clock.part("reference"):
        reference_version = await state.weights.reference_caught_up()
    # 2-4 are interrupt-safe: a Ctrl-C lets them finish, so the trainer's version and the run's agree
    async with InterruptSafe() as safe:
        with state.timeline.span("trainer", "score + train + publish", step=version):
            # 2. score: reference (or teacher) logprobs; PPO's critic values and advantages
            with clock.part("reference"):
                scored, score_metrics = await safe(algorithm.score(roles, state, batches, version))
            # 3. train and publish: the policy's step on every rank, each on its shard, then `version` in the store
            with clock.part("train"):
                per_rank = await safe(
                    within(
                        asyncio.gather(
                            *(rank.step.call_one(sent, version) for rank, sent in roles.trainer.sending(scored))
                        ),
                        cfg.timeouts.trainer_step_s + cfg.timeouts.publish_s,
                        "trainer_step_s + timeouts.publish_s",
                        f"the Trainer's step to version {version}",
                        state.where(),
                    )
                )
            metrics = per_rank[0]  # reduced over the ranks; rank 0's publish timing and bytes
            push = metrics.pop("publish")
            clock.reassign(push["push_s"], "train", "publish")
            # 4. what trains beside the policy (PPO's critic)
            with clock.part("train"):
                beside = await safe(algorithm.train_beside(roles, state, scored, version))
            s.version = version
    s.trainer_busy_s += time.perf_counter() - busy_start
    metrics = {**metrics, **score_metrics, **beside}
    if reference_version is not None:  # the version whose logprobs this step's batch was scored with
        metrics["reference/version"] = reference_version
    state.weights.follow_policy(version)
    if hold_s is not None:  # the generators take the device back (GPU: wake up)
        with clock.part("swap"):
            push = dict(push, hold_s=hold_s, release_s=await state.weights.take_back())
    s.mismatch.append((metrics["mismatch_abs_mean"], metrics["mismatch_abs_max"]))
    # 5. swap: every generator replica prefetches the new version and swaps between engine steps
    with clock.part("swap"):  # async: only the swap before it, if still running, is waited for
        await state.weights.swap_generators(version)
    state.rollouts.raise_if_failed()
    took = dict(step_s=time.perf_counter() - step_start, generated_tokens=s.rollouts.generated_tokens - tokens_before)
    line, state.buffer_stats = await step_line(
        roles, s, metrics, push, batches, buffer_before, staleness, sample_wait, **took
    )
    line.update(clock.finish())  # the parts sum to step_time/wall; the controller's share is the remainder
    state.log.log(version, line)
    if "generator/busy" in line:  # the engines' own count: the timeline's lanes see only what the controller times
        state.timeline.counter("generators busy", line["generator/busy"])
    state.timeline.mark(f"step {version}")
    return line


async def _collect(roles: Roles, state: StepState, clock: StepClock, buffer_before: dict) -> tuple[list, float, float]:
    """A batch of groups at the trainer's version, how long it was waited for, and its mean staleness. The next
    batch is sampled at version + 1: admission then admits only what that batch can still use."""
    s = state.shared
    with state.timeline.span("controller", "wait for a batch", step=s.version + 1), clock.waiting_for_samples():
        batches, sample_wait = await wait_for_batch(s, roles.buffer, state.rollouts.tasks, buffer_before)
    stored = s.admission.stored
    await s.admission.sampled((await roles.buffer.stats.call_one())["groups"], s.version + 1, stored)
    staleness, oldest = batch_staleness(batches, s.version)
    s.max_staleness = max(s.max_staleness, oldest)
    s.staleness_sum, s.staleness_steps = s.staleness_sum + staleness, s.staleness_steps + 1
    return batches, sample_wait, staleness


async def _step_aside(state: StepState, clock: StepClock) -> float | None:
    """A colocated trainer's step needs the device: the generators release it (GPU: sleep). Seconds held, or None."""
    if not state.colocated:
        return None
    with clock.part("swap"):
        return await state.weights.step_aside()
