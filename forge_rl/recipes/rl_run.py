"""The RL run: GRPO, PPO or on-policy distillation (an `Algorithm`), asynchronous: rollouts and training run
concurrently, joined by the replay buffer.

    run = RLRun(cfg, GRPO)        # cfg: GRPOConfig (forge_rl/recipes/grpo_config.py); PPO, DISTILL: their configs
    await run.start()             # checks, placement, actors, resume (forge_rl/recipes/startup.py)
    await run.evaluate()          # greedy held-out accuracy
    metrics = await run.rl_step() # collect, score, train, publish version + 1, swap the generators (rl_step.py)
    await run.checkpoint()
    summary = await run.finish()  # final evaluation, checkpoint, export, summary.json, curves.png
    await run.stop()              # every actor and its shared memory gone

`train(run)` (forge_rl/recipes/train.py) is the loop `make demo` runs over those steps; a notebook calls them one
at a time (docs/notebooks/interactive_grpo.ipynb). The run owns what lives across steps: its roles (`roles`), the
step's state (`step_state`), the evaluations, checkpoints and the finish. `async_mode: false` with
`max_policy_age: 0` is the strictly synchronous baseline: generate a batch, train, sync weights, repeat.
"""

import json
import time
from dataclasses import asdict
from pathlib import Path


from forge_rl.loop.checkpoint import save_checkpoint
from forge_rl.loop.eval import evaluate_held_out
from forge_rl.loop.rollout_tasks import RolloutTasks, rollout_once_of
from forge_rl.loop.train_loop import RunState, update_generators
from forge_rl.loop.weight_sync import WeightSync
from forge_rl.models import load_tokenizer, model_path
from forge_rl.observability import MetricsLogger, plot_run
from forge_rl.recipes import startup
from forge_rl.recipes.algorithm import GRPO, Algorithm
from forge_rl.recipes.run import RecipeRun
from forge_rl.recipes.grpo_checks import (
    check_config,
    check_group_size,
    check_moe,
    check_vision,
    check_prompt_lengths,
    check_task,
    derive_settings,
    settle_modes,
    dp_size,
)
from forge_rl.recipes.grpo_config import GRPOConfig
from forge_rl.recipes.roles import Roles
from forge_rl.recipes.grpo_report import eval_reward_name, occupancy, run_summary, summary_block, where_roles_run
from forge_rl.recipes.rl_step import rl_step
from forge_rl.recipes.step_state import StepState


class RLRun(RecipeRun):
    """One RL run of `algorithm`: its roles, its shared state (`state`: policy version, admission, drops), the
    step's (`step_state`), and what happens between steps."""

    def __init__(self, cfg: GRPOConfig, algorithm: Algorithm = GRPO):
        super().__init__(cfg)
        self.algorithm = algorithm
        self.checkpoint_dir = Path(cfg.trainer.checkpoint_dir)
        self.evals: list[tuple[int, float, float]] = []  # (step, training seconds so far, held-out accuracy)
        self.start_step = 0
        self.saved_step: int | None = None  # the step of the newest checkpoint written or resumed from
        self.state: RunState | None = None
        self.log: MetricsLogger | None = None
        self.roles: Roles | None = None  # every actor of the run, from start_roles() on
        self.placement = None  # where each role runs (forge_rl/runtime/placement.py), from start_roles() on
        self.generator_gpus = 0  # GPUs of each generator replica
        self.held_out: list = []  # the held-out examples the evaluations score
        self.rollouts: RolloutTasks | None = None  # from prepare() on
        self.agents = None  # agent.entry: the endpoint and the agent (forge_rl/agents/rollout.py's AgentRunner)
        self.weights: WeightSync | None = None  # from start() on
        self.step_state: StepState | None = None  # what rl_step reads and moves on, from start() on
        self._started: float | None = None  # the training clock: from the first step (evaluations move it on)
        self._stopped: float | None = None  # ... to the end of the last step
        self._gen_busy_start = self._eval_busy_s = 0.0
        self.engine_occupancy = 0.0  # mean sequences in a generator's batch over the run (finish() sets it)
        self._gen_at_start: dict = {}
        self._checkpointed: tuple[int, Path] | None = None  # (step, path): the last checkpoint written or resumed from

    @property
    def step(self) -> int:
        """Training steps taken (= the policy version; a resumed run starts at its checkpoint's)."""
        return self.state.version if self.state else 0

    # ---- start ----------------------------------------------------------------------------------------

    async def start_roles(self, hosts: dict) -> None:
        """Place the roles, start every actor, resume when asked to, open the metrics log."""
        cfg = self.cfg
        self.console.print(
            f"[bold]{self.algorithm.name}[/bold] {cfg.model}: starting actors (vLLM engine start takes ~30 s on CPU)"
        )
        if self.log_dir:
            self.console.print(
                f"the role processes' logs (vLLM, TorchTitan, Monarch) go to {self.log_dir}/ (--verbose: here)"
            )
        self.placement, self.generator_gpus, gpus = startup.place(cfg, hosts)
        self.console.print(self.placement.describe())
        roles = await startup.start_actors(self, hosts, gpus)
        self.roles = roles = await self.algorithm.start_beside(cfg, roles, self.placement, gpus)
        self.held_out = await roles.dataset.held_out.call_one(cfg.eval_size)
        if not self.held_out:
            self.console.print(
                "[yellow]eval_size=0: no held-out evaluations[/yellow]"
                if not cfg.eval_size
                else "[yellow]the task has no held-out set (task.held_out, task.held_out_fraction): no evaluations"
                "[/yellow]"
            )
        self.agents = await startup.start_agents(self, roles.generator)
        reference = roles.reference.mesh if roles.reference is not None else None
        self.weights = WeightSync(self.state, cfg, roles.generator, reference, self.timeline, self._where)
        resumed = await startup.resume(self, roles)
        if resumed is not None:  # finish() right away (resumed at `steps`) writes that checkpoint no second time
            self.start_step = self.saved_step = resumed
            self._checkpointed = (resumed, self.claim.resume_from)
        self.log = MetricsLogger(self.out, cfg.wandb_project, config=asdict(cfg), resume_step=resumed)
        self.step_state = StepState(
            cfg, self.state, self.rollouts, self.weights, self.timeline, self.log, self.placement.colocated, self._where
        )

    def prepare(self) -> None:
        """Everything that needs no actor: config checks, the model's path, the task's data, the output directory
        (claimed for this run, or refused) and the checkpoint to resume from (verified)."""
        cfg = self.cfg
        self.algorithm.check(cfg)
        for change in settle_modes(cfg, self.algorithm.zero_advantage_trains):
            self.console.print(f"[yellow]{change}[/yellow]")
        check_config(cfg)
        derive_settings(cfg)
        if self.algorithm.group_advantages(cfg):
            check_group_size(cfg, self.algorithm.name)
        self.model_dir = model_path(cfg.model)
        check_moe(cfg, self.model_dir)
        check_vision(cfg, self.model_dir)
        cfg.trainer.model = self.model_dir
        cfg.trainer.profile_dir = str(self.out / "profile")  # trainer.profile_steps' traces, one per rank and window
        rows = check_task(cfg)  # before the tokenizer: importing transformers takes seconds
        self.tokenizer = load_tokenizer(self.model_dir)
        check_prompt_lengths(cfg, rows, self.tokenizer, self.model_dir)
        self.claim_output(self.checkpoint_dir, self.algorithm.name.lower())
        self.buffer_cfg = cfg.buffer  # the user's settings, and beside them what the run decides for the buffer
        self.buffer_run = dict(
            max_policy_age=cfg.max_policy_age,
            dp_size=dp_size(cfg),
            pad_id=self.tokenizer.pad_token_id or 0,
            seed=cfg.seed,
            temperature=cfg.trainer.temperature,
        )
        self.state = RunState(cfg)
        self.rollouts = RolloutTasks(self.state, self.timeline)
        if cfg.launcher.kind == "slurm":
            self.console.print(
                f"[bold]{self.algorithm.name}[/bold] on Slurm: waiting for "
                f"{cfg.launcher.slurm.trainer_nodes} trainer + {cfg.launcher.slurm.generator_nodes} "
                "generator nodes"
            )

    # ---- the step (forge_rl/recipes/rl_step.py) ----------------------------------------------------

    async def before_steps(self) -> None:
        """What `train` does before the first step: the held-out accuracy at the start, then the rollout tasks,
        which generate, score and buffer groups beside every step."""
        if self.held_out:
            self.console.print(f"evaluating step {self.step} on {len(self.held_out)} held-out prompts ...")
        accuracy = (await self.evaluate())["eval/accuracy"]
        if self.held_out:  # none: said at start, and not as "nan%"
            self.console.print(
                f"held-out greedy accuracy at step {self.step}: {accuracy:.1%} "
                f"({len(self.held_out)} prompts, {self.eval_reward_name()})"
            )
        if self.step < self.cfg.steps:
            await self.start_rollouts()

    async def rl_step(self) -> dict[str, float]:
        """One step, for a notebook: `rl_step` on this run's roles and state (the rollouts start with the first)."""
        if not self.rollouts:
            await self.start_rollouts()
        return await rl_step(self.roles, self.step_state, self.algorithm)

    async def start_rollouts(self) -> None:
        """The rollout tasks, as many as admission allows (synchronous: the whole batch is generated at once)."""
        cfg = self.cfg
        rollout_once = rollout_once_of(
            cfg,
            self.tokenizer,
            dataset=self.roles.dataset,
            generator=self.roles.generator,
            buffer=self.roles.buffer,
            reward=self.roles.reward,
            stats=self.state.rollouts,
            agents=self.agents,
        )
        self._gen_at_start = await self.roles.generator.stats.route()
        self._gen_busy_start = self._gen_at_start["busy_s"]
        self.rollouts.start(
            rollout_once, cfg.rollout_tasks if cfg.async_mode else max(cfg.rollout_tasks, cfg.batch_groups)
        )
        self._started = time.perf_counter()

    # ---- between steps --------------------------------------------------------------------------------

    async def evaluate(self) -> dict[str, float]:
        """Greedy held-out evaluation of the generators' newest weights, logged at the current step. Rollouts
        wait meanwhile, and the time is not counted as training time."""
        t0, at_s = time.perf_counter(), self.training_s()
        await self.weights.generators_current()
        await self.state.admission.pause()
        try:
            with self.timeline.span("evaluation", "evaluate", step=self.step):
                scores = await evaluate_held_out(
                    self.cfg,
                    self.roles.generator,
                    self.roles.reward,
                    self.held_out,
                    self.tokenizer,
                    self.eval_reward_name(),
                    agents=self.agents,
                )
        finally:
            await self.state.admission.pause(False)
        self.evals.append((self.step, at_s, scores["eval/accuracy"]))
        self.log.log(self.step, scores)
        if self._started is not None and self._stopped is None:  # evaluations are not training time
            self._eval_busy_s += time.perf_counter() - t0
            self._started += time.perf_counter() - t0
        return scores

    async def checkpoint(self) -> Path:
        """The trainer's DCP checkpoint plus the buffer, the data position and the counters, as step-N. Every
        rollout started lands in the buffer first, so the checkpoint holds it."""
        if self._checkpointed is not None and self._checkpointed[0] == self.step:
            return self._checkpointed[1]  # e.g. the last step on the checkpoint_every schedule, then finish()
        await self.rollouts.land(self.console, "checkpoint")
        try:
            with self.timeline.span("trainer", "checkpoint", step=self.step):
                path = await self._save()
        finally:
            await self.state.admission.pause(False)
        return path

    async def _save(self) -> Path:
        path = await save_checkpoint(
            self.state,
            self.roles.trainer.mesh,
            self.roles.buffer,
            self.roles.dataset,
            self.step,
            self.checkpoint_dir,
            self.cfg.checkpoint_keep_last,
            self.algorithm.others(self.roles),
            run_id=self.claim.run_id,
        )
        self.saved_step, self._checkpointed = self.step, (self.step, path)
        return path

    async def save_on_interrupt(self) -> Path | None:
        """SIGTERM, Ctrl-C, a time limit: the step in flight has finished training and publishing (rl_step's
        interrupt-safe part: its version and the trainer's agree), the rollouts in flight get a moment to land in
        the buffer, and a final checkpoint is written, unless nothing was trained since the last one (or since the
        start: interrupted in the first evaluation)."""
        if self.step == (self.saved_step or 0):
            since = f"checkpoint step-{self.step}" if self.saved_step is not None else "the start"
            self.console.print(
                f"[yellow]interrupted at step {self.step}: nothing trained since {since}, "
                "so no checkpoint is written[/yellow]"
            )
            return None
        self.console.print(f"[yellow]interrupted at step {self.step}: saving a final checkpoint[/yellow]")
        await self.state.admission.quiesce(timeout_s=10)
        await self.rollouts.stop()
        return await self._save()

    async def finish(self) -> dict:
        """End of training: the generators take the final weights, a last evaluation, a checkpoint, the HF
        export; writes summary.json and curves.png and prints where everything is. Returns the summary. The
        rollouts in flight land in the buffer first, so the final checkpoint holds them (as every checkpoint)."""
        cfg = self.cfg
        await self.rollouts.land(self.console, "finish")
        await self.rollouts.stop()
        if self.weights is not None:
            await self.weights.generators_current()
        self._stopped = time.perf_counter()
        wall = self.training_s()
        # A replica respawning now (it died late in the run) joins the final evaluation with the final weights.
        if not await self.roles.generator.wait_healthy(timeout_s=300):
            self.console.print("[yellow]a generator replica is still down after 300 s; evaluating without it[/yellow]")
        await update_generators(
            self.state, self.roles.generator, self.state.version, cfg.timeouts.weight_load_s, self._where()
        )
        gen_stats = await self.roles.generator.stats.route()
        gen_busy_s = gen_stats["busy_s"] - self._gen_busy_start - self._eval_busy_s
        self.engine_occupancy = occupancy(self._gen_at_start, gen_stats)
        if self.step > self.start_step or not self.evals:  # none yet: finish() right after start() (a notebook)
            await self.evaluate()
        checkpoint = await self.checkpoint()
        if cfg.export_dir:
            await self.roles.trainer.mesh.export_hf.call(cfg.export_dir)  # with LoRA: merged into the base
            if cfg.trainer.lora.enabled:  # and the adapter alone, as PEFT saves one
                await self.roles.trainer.mesh.export_adapter.call(str(Path(cfg.export_dir) / "adapter"))
        summary = dict(await run_summary(self, wall, gen_busy_s), run_id=self.claim.run_id, checkpoint=str(checkpoint))
        # the engines' own count (requests in them), which sees every caller: rollouts, an agent gateway, Tinker
        generating = {"generators": round(1 - summary["generator_idle_fraction"], 3)}
        summary["busy_fraction"] = generating | {
            lane: round(f, 3) for lane, f in self.timeline.role_busy_fractions().items()
        }
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2))
        png = plot_run(self.out / "metrics.jsonl", self.out / "curves.png", title=f"{self.algorithm.name} {cfg.model}")
        self.timeline.write(self.out)
        self.console.print(
            summary_block(
                summary,
                self.eval_reward_name(),
                self.out,
                png,
                checkpoint,
                cfg.export_dir,
                cfg.trainer.lora.enabled,
                self.log_dir,
            )
        )
        return summary

    async def stop(self) -> None:
        """Stop the rollouts, every actor and proc of the run, and remove its shared memory (idempotent)."""
        if self.rollouts is not None:
            await self.rollouts.stop()
        if self.agents is not None:  # after the rollouts: no agent is left calling it
            agents, self.agents = self.agents, None
            await agents.close()
        if self.weights is not None:
            await self.weights.close()
        await super().stop()
        # the run's files last: a full disk refusing them stops nothing above
        if self.log is not None:
            log, self.log = self.log, None
            log.close()
        if self.timeline.spans and self.out.is_dir():  # an interrupted run's too
            self.timeline.write(self.out)

    def _where(self) -> str:
        """For a timeout's message: where the roles run, their logs, and where to resume."""
        return where_roles_run(self.cfg.launcher, self.log_dir, self.checkpoint_dir, self.claim)

    def training_s(self) -> float:
        """Seconds of training so far: from the first step on, start-up and evaluations excluded."""
        if self._started is None:
            return 0.0
        return (self._stopped or time.perf_counter()) - self._started

    def eval_reward_name(self) -> str:
        return eval_reward_name(self.cfg)
