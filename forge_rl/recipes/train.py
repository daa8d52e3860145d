"""The loop every RL run shares, over a run's steps: evaluate, then step until `steps` with evaluations and
checkpoints on their schedule, then finish; an interrupt saves a final checkpoint, and a dead role becomes one line
naming it.

    summary = await train(RLRun(cfg, GRPO))     # PPO, DISTILL: the same loop, another algorithm

`run` is an RLRun (forge_rl/recipes/rl_run.py); each step is `rl_step` (forge_rl/recipes/rl_step.py). A notebook
calls the same steps one at a time instead.
"""

import asyncio

from tqdm import tqdm

from forge_rl.actors.reward import RewardRoleDied
from forge_rl.deps.monarch import SupervisionError
from forge_rl.loop.train_loop import RoleDied, resume_hint, role_died
from forge_rl.recipes.grpo_report import console_line, shown_reward
from forge_rl.recipes.rl_step import rl_step
from forge_rl.runtime.faults import RoleStartFailed


async def train(run) -> dict:
    """The loop `make demo` runs: evaluate, then train step by step with evaluations and checkpoints on their
    schedule, then finish. An interrupt (in the first evaluation too) saves a final checkpoint when anything was
    trained since the last; a dead role becomes an error naming it."""
    try:
        async with run:
            try:
                await _first_evaluation(run)
                cfg = run.cfg
                if run.step < cfg.steps:  # generating, scoring and buffering groups beside every step
                    await run.start_rollouts()
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
                        line = await rl_step(run.roles, run.step_state, run.algorithm)
                        if cfg.eval_every and run.step % cfg.eval_every == 0 and run.step != cfg.steps:
                            line.update(await run.evaluate())
                        if cfg.checkpoint_every and run.step % cfg.checkpoint_every == 0:
                            await run.checkpoint()
                        bar.update(1)
                        bar.set_postfix(reward=shown_reward(line), acc=f"{run.evals[-1][2]:.0%}")
                        tqdm.write(console_line(run.step, line))
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


async def _first_evaluation(run) -> None:
    if run.held_out:
        run.console.print(f"evaluating step {run.step} on {len(run.held_out)} held-out prompts ...")
    accuracy = (await run.evaluate())["eval/accuracy"]
    if run.held_out:  # none: said at start, and not as "nan%"
        run.console.print(
            f"held-out greedy accuracy at step {run.step}: {accuracy:.1%} "
            f"({len(run.held_out)} prompts, {run.eval_reward_name()})"
        )
