"""A step's critical-path accounting: the parts sum to its wall time, a wait is split by the rollouts' phases."""

import asyncio
import time

import pytest

from forge_rl.observability.step_time import PREFIX, StepClock, split_window
from forge_rl.observability.timeline import CRITICAL_PATH, Span, Timeline, phase, rollout_lane


def test_parts_and_the_controller_remainder_sum_to_the_wall_time():
    timeline = Timeline()
    clock = StepClock(timeline, step=1)
    time.sleep(0.01)  # controller work before the first part
    with clock.part("train"):
        time.sleep(0.03)
    time.sleep(0.01)  # and between parts
    with clock.part("publish"):
        time.sleep(0.02)
    line = clock.finish()
    parts = {k: v for k, v in line.items() if k != PREFIX + "wall"}
    assert sum(parts.values()) == pytest.approx(line[PREFIX + "wall"], abs=1e-9)
    assert line[PREFIX + "train"] >= 0.03 and line[PREFIX + "publish"] >= 0.02
    assert line[PREFIX + "controller"] >= 0.02
    assert line[PREFIX + "generation"] == 0.0
    lane = [s for s in timeline.spans if s.lane == CRITICAL_PATH]
    assert [s.name for s in lane] == ["train", "publish"]
    assert "step (critical path)" not in timeline.role_busy_fractions()


def test_parts_do_not_nest_and_are_named():
    clock = StepClock(Timeline(), step=1)
    with pytest.raises(ValueError, match="not one of"):
        with clock.part("lunch"):
            pass
    with pytest.raises(RuntimeError, match="count twice"):
        with clock.part("train"):
            with clock.part("publish"):
                pass


def test_a_wait_is_split_by_the_highest_priority_rollout_phase():
    timeline = Timeline()
    timeline.spans += [
        Span("rollout 0", "rollout", 0.0, 10.0),  # the whole rollout is not a phase
        Span("rollout 0", "generate", 1.0, 4.0),
        Span("rollout 1", "reward", 3.0, 5.0),  # under generation from 3 to 4: counted as generation
        Span("rollout 0", "buffer", 5.0, 6.0),
        Span("trainer", "generate", 6.0, 9.0),  # not a rollout lane
    ]
    pieces = split_window(timeline, 0.5, 8.0)
    assert pieces == [
        ("wait", (0.5, 1.0)),
        ("generation", (1.0, 4.0)),
        ("reward", (4.0, 5.0)),
        ("buffer", (5.0, 6.0)),
        ("wait", (6.0, 8.0)),
    ]


def test_waiting_for_samples_counts_rollout_phases_still_running_when_the_wait_ends():
    async def scenario():
        timeline = Timeline()
        clock = StepClock(timeline, step=1)
        release = asyncio.Event()

        async def rollout():
            with rollout_lane(timeline, "rollout 0"):
                with phase("generate"):
                    await release.wait()

        task = asyncio.create_task(rollout())
        await asyncio.sleep(0)  # the rollout is now generating
        with clock.waiting_for_samples():
            await asyncio.sleep(0.03)
        release.set()
        await task
        return clock.finish(), timeline

    line, timeline = asyncio.run(scenario())
    assert line[PREFIX + "generation"] >= 0.03
    assert line[PREFIX + "wait"] < line[PREFIX + "generation"]
    with phase("generate"):  # outside a rollout task: no span, no error
        pass
    assert [s.name for s in timeline.spans if s.lane == "rollout 0"] == ["generate", "rollout"]
