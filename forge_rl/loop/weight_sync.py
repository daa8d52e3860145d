"""Where the generators' and the reference's weights stand against the trainer's, between steps.

After each publish the generator replicas swap to the new version (prefetch, then a swap between engine steps),
one swap at a time and in version order; an asynchronous run samples its next batch meanwhile, a synchronous one
waits. A colocated trainer takes the device from the generators for its step (`step_aside`, `take_back`: sleep
and wake on a GPU). A reference that follows the policy (reference.follow_every) loads an older version of it
while generation and training go on, and the version it scores with is known when its load is done."""

import asyncio
from collections.abc import Callable

from forge_rl.loop.train_loop import RunState, update_generators
from forge_rl.observability.timeline import Timeline
from forge_rl.runtime.timeouts import within


class WeightSync:
    """The generators' swap in flight and the reference's load in flight, for one run's `state`. `where()` says
    where the roles run, for a timeout's message."""

    def __init__(self, state: RunState, cfg, generator, reference, timeline: Timeline, where: Callable[[], str]):
        self.state, self.cfg, self.timeline, self.where = state, cfg, timeline, where
        self.generator, self.reference = generator, reference
        self.swap: asyncio.Task | None = None  # the generators' swap to the newest version
        self.reference_version = 0  # the policy version the reference's weights are
        self.reference_load: asyncio.Task | None = None  # its load of a newer one, started after a publish

    async def generators_current(self) -> None:
        """Wait for the swap in flight (if any): the generators then hold the newest published version."""
        if self.swap is not None:
            self.state.last_updates, self.swap = await self.swap, None

    async def swap_generators(self, version: int) -> None:
        """Every replica prefetches `version` and swaps between engine steps, after the swap before it. A
        synchronous run waits for it; an asynchronous one goes on sampling."""
        await self.generators_current()
        self.swap = asyncio.create_task(self._timed_swap(version))
        if not self.cfg.async_mode:
            await self.generators_current()

    async def _timed_swap(self, version: int) -> list[dict]:
        with self.timeline.span("weight swaps", "weight swap", version=version):
            return await update_generators(
                self.state, self.generator, version, self.cfg.timeouts.weight_load_s, self.where()
            )

    async def step_aside(self) -> float:
        """Colocated: the generators take the newest version, then give the device to the trainer (GPU: sleep).
        Returns the longest replica's hold time."""
        await self.generators_current()
        return max(await self.generator.hold.call_all(), default=0.0)

    async def take_back(self) -> float:
        """Colocated: the generators take the device back after the trainer's step (GPU: wake up)."""
        return max(await self.generator.release.call_all(), default=0.0)

    async def reference_caught_up(self) -> int | None:
        """The policy version the reference scores with (None: no reference), once its load in flight is done."""
        if self.reference_load is not None:
            task, self.reference_load = self.reference_load, None
            self.reference_version = (await task).get(0)
        return self.reference_version if self.reference is not None else None

    def follow_policy(self, step: int) -> None:
        """reference.follow_every: every M steps, right after the publish, the reference starts loading the
        policy's version step - follow_lag from the weight store."""
        every, target = self.cfg.reference.follow_every, step - self.cfg.reference.follow_lag
        if self.reference is None or not every or step % every or target <= self.reference_version:
            return
        self.reference_load = asyncio.create_task(
            within(
                self.reference.follow.call(target),
                self.cfg.timeouts.weight_load_s,
                "weight_load_s",
                f"the Reference's load of policy version {target}",
                self.where(),
            )
        )

    async def close(self) -> None:
        """Cancel a reference load started after the last publish: nobody scores with it."""
        if self.reference_load is not None:
            self.reference_load.cancel()
            await asyncio.gather(self.reference_load, return_exceptions=True)
            self.reference_load = None
