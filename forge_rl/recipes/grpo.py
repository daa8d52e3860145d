"""GRPO, asynchronous: rollouts and training run concurrently, joined by the replay buffer.

    run = GRPORun(cfg)            # cfg: GRPOConfig (forge_rl/recipes/grpo_config.py)
    await run.start()             # checks, placement, actors, resume (forge_rl/recipes/startup.py)
    await run.evaluate()          # greedy held-out accuracy
    metrics = await run.rl_step()   # collect, score, train, publish version + 1, swap the generators
    await run.checkpoint()
    summary = await run.finish()  # final evaluation, checkpoint, export, summary.json, curves.png
    await run.stop()              # every actor and its shared memory gone

`train(run)` (forge_rl/recipes/train.py) is the loop `make demo` runs over those steps; a notebook calls them one
at a time (docs/notebooks/interactive_grpo.ipynb). `GRPORun.rl_step` is one step read top to bottom: each stage is
one call away (the rollout tasks in forge_rl/loop/rollout_tasks.py, the generators' and reference's weights in
forge_rl/loop/weight_sync.py, the trainer's endpoints in forge_rl/actors/trainer.py). An algorithm that adds a
stage subclasses the run and overrides `score` or `train_beside` (forge_rl/recipes/ppo.py, distill.py).
`async_mode: false` with `max_policy_age: 0` is the strictly synchronous baseline: generate a batch, train, sync
weights, repeat.

The shape follows TorchTitan's train.py (the loop readable in one file, the model and its parallelism elsewhere)
and tinker-cookbook's short loop beside a config.
"""

import asyncio
import contextlib
import json
import time
from dataclasses import asdict
from pathlib import Path


from forge_rl.actors.reference import Reference
from forge_rl.actors.trainer import Trainer
from forge_rl.loop.checkpoint import save_checkpoint
from forge_rl.loop.eval import evaluate_held_out
from forge_rl.loop.rollout_tasks import RolloutTasks, rollout_once_of
from forge_rl.loop.train_loop import (
    RunState,
    batch_staleness,
    batches_for_ranks,
    call_each_rank,
    call_for_batches,
    update_generators,
    wait_for_batch,
)
from forge_rl.loop.weight_sync import WeightSync
from forge_rl.models import load_tokenizer, model_path
from forge_rl.observability import MetricsLogger, plot_run
from forge_rl.observability.step_time import StepClock
from forge_rl.recipes import startup
from forge_rl.recipes.run import RecipeRun
from forge_rl.recipes.grpo_checks import (
    check_config,
    check_group_size,
    check_moe,
    check_prompt_lengths,
    check_task,
    derive_settings,
    settle_modes,
    dp_size,
)
from forge_rl.recipes.grpo_config import GRPOConfig
from forge_rl.recipes.roles import Roles
from forge_rl.recipes.grpo_report import (
    eval_reward_name,
    occupancy,
    run_summary,
    step_line,
    summary_block,
    where_roles_run,
)
from forge_rl.recipes.train import train
from forge_rl.runtime.timeouts import within


class GRPORun(RecipeRun):
    """One GRPO run: its actors, its shared state (`state`: policy version, admission, drops) and its steps."""

    def __init__(self, cfg: GRPOConfig):
        super().__init__(cfg)
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
        self._step_task: asyncio.Future | None = None  # score + train + publish of the step in flight
        self._started: float | None = None  # the training clock: from the first step (evaluations move it on)
        self._stopped: float | None = None  # ... to the end of the last step
        self._gen_busy_start = self._eval_busy_s = 0.0
        self.engine_occupancy = 0.0  # mean sequences in a generator's batch over the run (finish() sets it)
        self._gen_at_start: dict = {}
        self._checkpointed: tuple[int, Path] | None = None  # (step, path): the last checkpoint written or resumed from
        self._buffer_stats: dict | None = None  # ReplayBuffer.stats as the last step's line read them

    @property
    def step(self) -> int:
        """Training steps taken (= the policy version; a resumed run starts at its checkpoint's)."""
        return self.state.version if self.state else 0

    # ---- what an algorithm changes ----------------------------------------------------------------------

    def reference_model(self) -> str | None:
        """Whose logprobs fill TrainBatch.ref_logprobs every step: the starting policy when the KL penalty needs
        it (trainer.loss.kl_coef > 0); a distillation run returns its teacher."""
        return self.cfg.trainer.model if self.cfg.trainer.loss.kl_coef > 0 else None

    def group_advantages(self) -> bool:
        """Whether the advantage is relative to the group of a prompt's samples (it needs group_size >= 2)."""
        return True

    def algorithm(self) -> str:
        """The run's name on the console and its plots: GRPO, PPO, Distill."""
        return type(self).__name__.removesuffix("Run")

    def critic_parameters(self) -> int:
        """Parameters of a critic trained on the trainer's ranks (PPO), for the colocated GPU's memory plan."""
        return 0

    def other_trained(self) -> dict:
        """Actors trained beside the policy, checkpointed and resumed with the run (PPO's critic): name -> actor."""
        return {}

    def zero_advantage_trains(self) -> str | None:
        """Why a group whose rewards are all equal still carries a training signal (PPO's critic, a teacher), so
        the buffer keeps it; None when it does not, and buffer.drop_zero_advantage drops it."""
        return None

    async def score(self, batches: list, version: int) -> tuple[list, dict]:
        """The batch made ready to train at `version`: its reference (or teacher) logprobs filled in. Returns it
        and metrics of the scoring (PPO adds its critic's values and advantages here)."""
        if self.roles.reference is None:
            return batches, {}
        filled = await within(
            call_for_batches(
                self.roles.reference, Reference.fill_ref_logprobs, batches, self.roles.shards["reference"]
            ),
            self.cfg.timeouts.reference_s,
            "reference_s",
            f"the Reference's fill_ref_logprobs for version {version}",
            self._where(),
        )
        return filled, {}

    async def train_beside(self, batches: list, version: int) -> dict:
        """What trains beside the policy while its weights publish (PPO's critic); its metrics, named 'role/...'."""
        return {}

    # ---- start ----------------------------------------------------------------------------------------

    async def start_roles(self, hosts: dict) -> None:
        """Place the roles, start every actor, resume when asked to, open the metrics log."""
        cfg = self.cfg
        self.console.print(
            f"[bold]{self.algorithm()}[/bold] {cfg.model}: starting actors (vLLM engine start takes ~30 s on CPU)"
        )
        if self.log_dir:
            self.console.print(
                f"the role processes' logs (vLLM, TorchTitan, Monarch) go to {self.log_dir}/ (--verbose: here)"
            )
        self.placement, self.generator_gpus, gpus = startup.place(cfg, hosts)
        self.console.print(self.placement.describe())
        self.roles = roles = await self.start_actors(hosts, gpus)
        self.held_out = await roles.dataset.held_out.call_one(cfg.eval_size)
        if not self.held_out:
            self.console.print(
                "[yellow]eval_size=0: no held-out evaluations[/yellow]"
                if not cfg.eval_size
                else "[yellow]the task has no held-out set (task.held_out, task.held_out_fraction): no evaluations"
                "[/yellow]"
            )
        self.agents = await startup.start_agents(self, roles.generator)
        self.weights = WeightSync(self.state, cfg, roles.generator, roles.reference, self.timeline, self._where)
        resumed = await startup.resume(self, roles)
        if resumed is not None:  # finish() right away (resumed at `steps`) writes that checkpoint no second time
            self.start_step = self.saved_step = resumed
            self._checkpointed = (resumed, self.claim.resume_from)
        self.log = MetricsLogger(self.out, cfg.wandb_project, config=asdict(cfg), resume_step=resumed)

    async def start_actors(self, hosts: dict, gpus: list[str]) -> Roles:
        """Every actor of the run (forge_rl/recipes/startup.py); PPO starts its critic after them."""
        return await startup.start_actors(self, hosts, gpus)

    def prepare(self) -> None:
        """Everything that needs no actor: config checks, the model's path, the task's data, the output directory
        (claimed for this run, or refused) and the checkpoint to resume from (verified)."""
        cfg = self.cfg
        for change in settle_modes(cfg, self.zero_advantage_trains()):
            self.console.print(f"[yellow]{change}[/yellow]")
        check_config(cfg)
        derive_settings(cfg)
        if self.group_advantages():
            check_group_size(cfg, self.algorithm())
        self.model_dir = model_path(cfg.model)
        check_moe(cfg, self.model_dir)
        cfg.trainer.model = self.model_dir
        cfg.trainer.profile_dir = str(self.out / "profile")  # trainer.profile_steps' traces, one per rank and window
        rows = check_task(cfg)  # before the tokenizer: importing transformers takes seconds
        self.tokenizer = load_tokenizer(self.model_dir)
        check_prompt_lengths(cfg, rows, self.tokenizer, self.model_dir)
        self.claim_output(self.checkpoint_dir, self.algorithm().lower())
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
                f"[bold]{self.algorithm()}[/bold] on Slurm: waiting for "
                f"{cfg.launcher.slurm.trainer_nodes} trainer + {cfg.launcher.slurm.generator_nodes} "
                "generator nodes"
            )

    # ---- the step -------------------------------------------------------------------------------------

    async def rl_step(self) -> dict[str, float]:
        """One step: collect a batch at the policy version, score it, train on it, publish version + 1, swap the
        generators to it (async: while the next step collects). Returns the step's metrics line, also logged, with
        where the step's wall time went on its critical path (step_time/<part>, forge_rl/observability/step_time.py;
        each part a span on the timeline's critical-path lane)."""
        s = self.state
        if not self.rollouts:  # the rollout tasks start with the first step and run beside every step after it
            await self._start_rollouts()
        clock = StepClock(self.timeline, step=s.version + 1)
        step_start, tokens_before = time.perf_counter(), s.rollouts.generated_tokens
        # the buffer's stats as the last step's line read them (a round trip fewer; nothing is lost in between)
        buffer_before = self._buffer_stats or await self.roles.buffer.stats.call_one()
        # 1. collect: the rollout tasks generate, score and buffer groups; take a batch at the trainer's version
        batches, sample_wait, staleness = await self._collect(clock, buffer_before)
        if self.placement.colocated:  # the trainer's device
            with clock.part("swap"):
                hold_s = await self.weights.step_aside()
        else:
            hold_s = None

        busy_start = time.perf_counter()
        with clock.part("reference"):
            reference_version = await self.weights.reference_caught_up()
        # shielded: an interrupt lets it finish
        self._step_task = asyncio.ensure_future(self._score_train_publish(batches, clock))
        metrics, push = await asyncio.shield(self._step_task)
        s.trainer_busy_s += time.perf_counter() - busy_start
        if reference_version is not None:  # the version whose logprobs this step's batch was scored with
            metrics["reference/version"] = reference_version
        self.weights.follow_policy(self.step)
        if hold_s is not None:  # the generators take the device back (GPU: wake up)
            with clock.part("swap"):
                push = dict(push, hold_s=hold_s, release_s=await self.weights.take_back())
        s.mismatch.append((metrics["mismatch_abs_mean"], metrics["mismatch_abs_max"]))
        # 5. swap: every generator replica prefetches the new version and swaps between engine steps
        with clock.part("swap"):  # async: only the swap before it, if still running, is waited for
            await self.weights.swap_generators(s.version)
        self.rollouts.raise_if_failed()
        took = dict(
            step_s=time.perf_counter() - step_start, generated_tokens=s.rollouts.generated_tokens - tokens_before
        )
        line, self._buffer_stats = await step_line(
            self, metrics, push, batches, buffer_before, staleness, sample_wait, **took
        )
        line.update(clock.finish())  # the parts sum to step_time/wall; the controller's share is the remainder
        self.log.log(self.step, line)
        self.timeline.mark(f"step {self.step}")
        return line

    async def _score_train_publish(self, batches: list, clock: StepClock) -> tuple[dict, dict]:
        """Score, train, publish version + 1 (the step in flight: an interrupt lets it finish)."""
        s, cfg = self.state, self.cfg
        version, t, where = s.version + 1, cfg.timeouts, self._where()
        with self.timeline.span("trainer", "score + train + publish", step=version):
            # 2. score: reference (or teacher) logprobs; PPO's critic values and advantages
            with clock.part("reference"):
                scored, score_metrics = await self.score(batches, version)
            # 3. train and publish: the policy's step on each rank's own data-parallel shard, then version + 1 into
            # the weight store (Trainer.step)
            sent = batches_for_ranks(scored, self.roles.shards["trainer"])
            with clock.part("train"):
                metrics = (
                    await within(
                        call_each_rank(self.roles.trainer, Trainer.step, sent, version),
                        t.trainer_step_s + t.publish_s,
                        "trainer_step_s + timeouts.publish_s",
                        f"the Trainer's step to version {version}",
                        where,
                    )
                )[0]
            push = metrics.pop("publish")  # rank 0's: the publish's timing and bytes
            clock.reassign(push["push_s"], "train", "publish")
            # 4. what trains beside the policy (PPO's critic)
            with clock.part("train"):
                beside = await self.train_beside(scored, version)
        s.version = version
        return {**metrics, **score_metrics, **beside}, push

    async def _collect(self, clock: StepClock, buffer_before: dict) -> tuple[list, float, float]:
        """A batch of groups at the trainer's version, how long it was waited for, and its mean staleness. The next
        batch is sampled at version + 1: admission then admits only what that batch can still use."""
        s = self.state
        with self.timeline.span("controller", "wait for a batch", step=s.version + 1), clock.waiting_for_samples():
            batches, sample_wait = await wait_for_batch(s, self.roles.buffer, self.rollouts.tasks, buffer_before)
        stored = s.admission.stored
        await s.admission.sampled((await self.roles.buffer.stats.call_one())["groups"], s.version + 1, stored)
        staleness, oldest = batch_staleness(batches, s.version)
        s.max_staleness = max(s.max_staleness, oldest)
        s.staleness_sum, s.staleness_steps = s.staleness_sum + staleness, s.staleness_steps + 1
        return batches, sample_wait, staleness

    async def _start_rollouts(self) -> None:
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
            with self.timeline.span("generators", "evaluate", step=self.step):
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
            self.roles.trainer,
            self.roles.buffer,
            self.roles.dataset,
            self.step,
            self.checkpoint_dir,
            self.cfg.checkpoint_keep_last,
            self.other_trained(),
            run_id=self.claim.run_id,
        )
        self.saved_step, self._checkpointed = self.step, (self.step, path)
        return path

    async def save_on_interrupt(self) -> Path | None:
        """SIGTERM, Ctrl-C, a time limit: the step in flight finishes (its version and the trainer's agree), the
        rollouts in flight get a moment to land in the buffer, and a final checkpoint is written, unless nothing
        was trained since the last one (or since the start: interrupted in the first evaluation)."""
        if self._step_task is not None and not self._step_task.done():
            with contextlib.suppress(Exception):
                await self._step_task
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
            await self.roles.trainer.export_hf.call(cfg.export_dir)  # with LoRA: merged into the base
            if cfg.trainer.lora.enabled:  # and the adapter alone, as PEFT saves one
                await self.roles.trainer.export_adapter.call(str(Path(cfg.export_dir) / "adapter"))
        summary = dict(await run_summary(self, wall, gen_busy_s), run_id=self.claim.run_id, checkpoint=str(checkpoint))
        summary["busy_fraction"] = {lane: round(f, 3) for lane, f in self.timeline.role_busy_fractions().items()}
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2))
        png = plot_run(self.out / "metrics.jsonl", self.out / "curves.png", title=f"{self.algorithm()} {cfg.model}")
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


CONFIG = GRPOConfig  # what the command line and `forge_rl.launch submit --recipe grpo` read


async def main(cfg: GRPOConfig) -> dict:
    return await train(GRPORun(cfg))
