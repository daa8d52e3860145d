"""The loop every run shares, over its algorithm's steps: what comes before the first step, then steps until
`steps` with evaluations and checkpoints on their schedule, then finish; an interrupt saves a final checkpoint, and
a dead role becomes one line naming it.

    summary = await train(RLRun(cfg, GRPO))     # PPO, DISTILL: the same loop, another algorithm
    summary = await train(SFTRun(cfg))          # SFT: the same loop over sft_step

Each step is `run.algorithm.step(run.roles, run.step_state, run.algorithm)`: `rl_step` (forge_rl/recipes/rl_step.py)
for the RL algorithms, `sft_step` (forge_rl/recipes/sft_step.py) for SFT. A notebook calls the same steps one at a
time instead.
"""

import asyncio

from tqdm import tqdm

from forge_rl.actors.reward import RewardRoleDied
from forge_rl.deps.monarch import SupervisionError
from forge_rl.loop.train_loop import RoleDied, resume_hint, role_died
from forge_rl.runtime.faults import RoleStartFailed


async def train(run) -> dict:
    """The loop `make demo` runs: evaluate, then train step by step with evaluations and checkpoints on their
    schedule, then finish. An interrupt (in the first evaluation too) saves a final checkpoint when anything was
    trained since the last; a dead role becomes an error naming it."""
    try:
        async with run:
            try:
                await run.before_steps()  # RL: the first evaluation, then the rollouts start
                cfg, algorithm = run.cfg, run.algorithm
                # no bar without a terminal (nohup, CI, a batch step): the step lines say it all
                with tqdm(
                    total=cfg.steps,
                    initial=run.step,
                    desc=f"{run.algorithm.name} steps",
                    unit="step",
                    dynamic_ncols=True,
                    disable=None,
                ) as bar:
                    while run.step < cfg.steps:
                        line = await algorithm.step(run.roles, run.step_state, algorithm)
                        if cfg.eval_every and run.step % cfg.eval_every == 0 and run.step != cfg.steps:
                            line.update(await run.evaluate())
                        if cfg.checkpoint_every and run.step % cfg.checkpoint_every == 0:
                            await run.checkpoint()
                        bar.update(1)
                        bar.set_postfix(algorithm.postfix(run, line))
                        if (shown := algorithm.console_line(run.step, line)) is not None:
                            tqdm.write(shown)
                        if "profile/summary" in line:  # trainer.profile_steps: the window's top operators, rank 0's
                            tqdm.write(line["profile/summary"])
            except (KeyboardInterrupt, asyncio.CancelledError):
                await run.save_on_interrupt()
                raise
            return await run.finish()
    except (SupervisionError, RoleStartFailed) as e:  # a role's process died: name it and the checkpoint to resume from
        roles = run.provisioner.mesh_names if run.provisioner else ()
        raise role_died(e, run.checkpoint_dir, run.log_dir, _run_id(run), roles) from e
    except RewardRoleDied as e:  # a reward model's or judge's process died (the reward actor names it)
        raise RoleDied(f"{e}; {resume_hint(run.checkpoint_dir, _run_id(run))}") from e


def _run_id(run) -> str | None:
    return run.claim.run_id if run.claim else None
