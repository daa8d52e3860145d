"""One SFT step: the dataset's next batch -> Trainer.step on every rank -> the step's metrics line.

    line = await sft_step(roles, state, SFT)     # train (forge_rl/recipes/train.py) calls it through SFT.step

The SFT run (forge_rl/recipes/sft.py) makes `roles` and `state` at start, as the RL run does for `rl_step`; the
loop around the step (evaluations, checkpoints, the interrupt, the finish) is the same `train`.
"""

import asyncio
import time
from dataclasses import dataclass, field

from forge_rl.actors.trainer import Trainer
from forge_rl.data.sft_sources import train_batches
from forge_rl.loop.ranks import Ranks
from forge_rl.observability import MetricsLogger
from forge_rl.observability.timeline import Timeline
from forge_rl.runtime.interrupt_safe import InterruptSafe


@dataclass(frozen=True)
class SFTRoles:
    trainer: Ranks[Trainer]  # dp x tp ranks; the evaluation's generator starts with the first evaluation


@dataclass
class SFTState:
    source: object  # the dataset's examples in a seeded order (forge_rl/data/sft_sources.py)
    batch_size: int  # sequences per step, over every data-parallel rank
    dp: int  # data-parallel ranks: one TrainBatch each
    pad_id: int
    timeline: Timeline
    log: MetricsLogger
    started: float  # time.perf_counter() when training started (train/elapsed_s)
    step: int = 0  # optimizer steps taken (a resumed run starts at its checkpoint's)
    losses: list[float] = field(default_factory=list)


async def sft_step(roles: SFTRoles, state: SFTState, algorithm) -> dict[str, float]:
    """One optimizer step on batch `state.step` (one TrainBatch per data-parallel rank), logged and returned. The
    step is interrupt-safe: a Ctrl-C lets it finish and be logged before the interrupt goes on."""
    version = state.step + 1
    with state.timeline.span("controller", "batch", step=version):
        batches = train_batches(state.source, state.step, state.batch_size, state.dp, state.pad_id)
    async with InterruptSafe() as safe:
        with state.timeline.span("trainer", "train step", step=version):
            steps = (rank.step.call_one(sent) for rank, sent in roles.trainer.sending(batches))
            per_rank = await safe(asyncio.gather(*steps))
        line = _logged(state, per_rank[0])
    return line


def _logged(state: SFTState, m: dict) -> dict[str, float]:
    """The step's line from the trainer's metrics (reduced over ranks), into metrics.jsonl."""
    state.step = int(m["step"])
    state.losses.append(m["loss"])
    line = {
        "train/loss": m["loss"],
        "train/grad_norm": m["grad_norm"],
        "train/lr": m["lr"],
        "train/tokens_per_s": m["tokens_per_s"],
        "train/step_s": m["step_s"],
        "train/mfu": m["mfu"],
        "train/elapsed_s": time.perf_counter() - state.started,
    }
    state.log.log(state.step, line)
    state.timeline.mark(f"step {state.step}")
    if "profile/summary" in m:  # trainer.profile_steps: the window's top operators, rank 0's (train prints it)
        line["profile/summary"] = m["profile/summary"]
    return line
