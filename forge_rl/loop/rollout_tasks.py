"""The run's rollout tasks: R coroutines in the controller, each taking a prompt whenever admission lets it,
generating its group on a generator replica, scoring it and putting it in the buffer (forge_rl/loop/rollout.py
for a task's rows, forge_rl/loop/multiturn.py for an environment's turns). They start with the first training
step and run beside the steps until the run lands or stops them."""

import asyncio
from collections.abc import Awaitable, Callable

from forge_rl.agents.rollout import rollout_agent_from_dataset
from forge_rl.envs import env_factory
from forge_rl.loop.lengths import LengthDraws
from forge_rl.loop.multiturn import rollout_env_from_dataset
from forge_rl.loop.turn_renderer import TurnRenderer
from forge_rl.loop.rollout import rollout_from_dataset, rollout_loop
from forge_rl.loop.train_loop import RunState, raise_if_failed
from forge_rl.observability.timeline import Timeline, rollout_lane

LAND_TIMEOUT_S = 60.0  # how long rollouts in flight get to put their groups in the buffer before a checkpoint


def rollout_once_of(
    cfg, tokenizer, *, dataset, generator, buffer, reward, stats, agents=None
) -> Callable[[], Awaitable[bool]]:
    """One rollout as the config asks for it: a group of single completions scored by the reward actor, a
    group of multi-turn trajectories played against `cfg.env`, or a group of an agent's episodes through the run's
    endpoint (`agents`, forge_rl/agents/rollout.py's AgentRunner, with cfg.agent.entry)."""
    if cfg.agent.enabled:
        return lambda: rollout_agent_from_dataset(
            agents=agents,
            dataset=dataset,
            reward=reward,
            buffer=buffer,
            group_size=cfg.group_size,
            stats=stats,
            scale_advantages_by_std=cfg.scale_advantages_by_std,
        )
    actors = dict(
        dataset=dataset,
        generator=generator,
        buffer=buffer,
        group_size=cfg.group_size,
        stats=stats,
        scale_advantages_by_std=cfg.scale_advantages_by_std,
    )
    max_tokens = cfg.generator.sampling.get("max_tokens", 16)
    if cfg.env.name is not None:
        turns = dict(
            make_env=env_factory(cfg.env, cfg),
            env_cfg=cfg.env,
            max_tokens=max_tokens,
            renderer=TurnRenderer(tokenizer, **cfg.chat_template_kwargs),
        )
        return lambda: rollout_env_from_dataset(**turns, **actors)
    lengths = LengthDraws(cfg.generator.lengths, max_tokens) if cfg.generator.lengths.enabled else None
    max_age = cfg.max_policy_age if cfg.stale_in_flight == "requeue" else None
    return lambda: rollout_from_dataset(
        reward=reward, overlong=cfg.overlong, max_tokens=max_tokens, lengths=lengths, max_age=max_age, **actors
    )


class RolloutTasks:
    """The rollout tasks of one run (`state`: its admission and stop event), each a busy lane on `timeline`."""

    def __init__(self, state: RunState, timeline: Timeline):
        self.state, self.timeline = state, timeline
        self.tasks: list[asyncio.Task] = []

    def __bool__(self) -> bool:
        return bool(self.tasks)

    def start(self, rollout_once: Callable[[], Awaitable[bool]], count: int) -> None:
        """`count` tasks, each running rollout_once for as long as admission admits and the run goes on."""

        def timed(lane: str):
            return lambda: self._timed(lane, rollout_once())

        self.tasks = [
            asyncio.create_task(rollout_loop(self.state.admission, self.state.stop, timed(f"rollout {i}")))
            for i in range(count)
        ]

    async def _timed(self, lane: str, rollout: Awaitable[bool]) -> bool:
        with rollout_lane(self.timeline, lane):  # its phases (generate, reward, buffer) go on its lane too
            return await rollout

    def raise_if_failed(self) -> None:
        """A rollout task that died raises here (a dead role, a reward that always fails), named."""
        raise_if_failed(self.tasks)

    async def land(self, console, why: str) -> None:
        """Admit no more rollouts and let those in flight put their groups in the buffer (LAND_TIMEOUT_S at most;
        `why` names the caller in the warning when some do not). Admission stays paused: resume it to go on."""
        if self.tasks and not await self.state.admission.quiesce(timeout_s=LAND_TIMEOUT_S):
            console.print(
                f"[yellow]{why}: rollouts still in flight after {LAND_TIMEOUT_S:.0f} s; their prompts "
                "are skipped on resume[/yellow]"
            )

    async def stop(self) -> None:
        """Cancel every rollout task and wait for them to end."""
        self.state.stop.set()
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.tasks = []
