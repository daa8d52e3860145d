"""GRPO, asynchronous: rollouts and training run concurrently, joined by the replay buffer.

    run = GRPORun(cfg)            # cfg: GRPOConfig (forge_rl/recipes/grpo_config.py)
    await run.start()             # checks, placement, actors, resume
    await run.evaluate()          # greedy held-out accuracy
    metrics = await run.train_step()   # sample, train, publish version + 1, swap the generators
    await run.checkpoint()
    summary = await run.finish()  # final evaluation, checkpoint, export, summary.json, curves.png
    await run.stop()              # every actor and its shared memory gone

`train(run)` at the bottom is the loop `make demo` runs over those steps; a notebook calls them one at a time
(docs/notebooks/interactive_grpo.ipynb), and an algorithm that adds a stage subclasses the run
(forge_rl/recipes/distill.py). Rollout tasks run in this controller from the first `train_step` on: prompt ->
generator.generate(n=G) -> reward.score -> group advantages -> buffer.add. `async_mode: false` with
`max_policy_age: 0` is the strictly synchronous baseline: generate a batch, train, sync weights, repeat.

What we took from others: TorchTitan keeps its `Trainer` in the library and experiments as configs (the run
lives here, `apps/grpo/main.py` only parses the command line); tinker-cookbook's RL loop is one short function
over named steps beside a config blueprint (`train` below); nanoGPT keeps one idea per file (the config and
its checks, the run, and what it reports are three files).
"""

import asyncio
import contextlib
import copy
import json
import socket
import statistics
import time
from dataclasses import asdict, replace
from pathlib import Path

from rich.console import Console
from tqdm import tqdm

from forge_rl.actors.dataset import PromptDataset
from forge_rl.actors.generator import Generator
from forge_rl.actors.reference import Reference
from forge_rl.actors.replay_buffer import ReplayBuffer, ReplayBufferConfig
from forge_rl.actors.reward import RewardActor, RewardRoleDied, judge_engine_args
from forge_rl.actors.reward_model import RewardModel
from forge_rl.actors.trainer import Trainer
from forge_rl.loop.checkpoint import resume_from_checkpoint, save_checkpoint
from forge_rl.config import to_yaml
from forge_rl.deps.monarch import SupervisionError
from forge_rl.launch.launcher import LauncherConfig, run_hosts, weight_server
from forge_rl.runtime.provisioner import visible_gpus
from forge_rl.envs import env_factory
from forge_rl.loop.eval import evaluate_task
from forge_rl.models import load_tokenizer, model_path, resolve_model_path
from forge_rl.loop.multiturn import TurnRenderer, evaluate_env, rollout_env_from_dataset
from forge_rl.loop.run_folder import RunClaim, claim_output_dir
from forge_rl.observability import MetricsLogger, plot_run
from forge_rl.observability.timeline import Timeline
from forge_rl.recipes.grpo_config import (GRPOConfig, check_config, check_group_size, check_moe, check_prompt_lengths,
                                          check_task, dp_size, max_prompt_tokens)
from forge_rl.recipes.grpo_report import (StepRecord, batch_rewards, console_line, drops, shown_reward, step_metrics,
                                          summary_block)
from forge_rl.runtime.memory_plan import ModelShape, gpu_total_bytes, plan_memory
from forge_rl.runtime.placement import Placement, plan_placement, plan_reward_models
from forge_rl.runtime.timeouts import TimeoutsConfig, within
from forge_rl.loop.lengths import LengthDraws
from forge_rl.loop.rollout import rollout_from_dataset, rollout_loop
from forge_rl.loop.train_loop import (
    RoleDied, Run, batch_staleness, batches_for_ranks, call_each_rank, data_shards, raise_if_failed, resume_hint,
    role_died, update_generators, wait_for_batch,
)


class GRPORun:
    """One GRPO run: its actors, its shared state (`state`: policy version, admission, drops) and its steps."""

    def __init__(self, cfg: GRPOConfig):
        # The run's own copy: it fills in derived settings (the trainer's temperature, token_sum's constant, the
        # model's path), which must not leak into a second run made from the same object (a notebook).
        self.cfg = copy.deepcopy(cfg)
        self.console = Console(soft_wrap=True)  # no hard wraps at 80 columns in a log file
        self.out = Path(cfg.output_dir)
        self.log_dir = None if cfg.verbose else self.out / "logs"
        self.checkpoint_dir = Path(cfg.trainer.checkpoint_dir)
        self.evals: list[tuple[int, float, float]] = []  # (step, training seconds so far, held-out accuracy)
        self.start_step = 0
        self.saved_step: int | None = None  # the step of the newest checkpoint written or resumed from
        self.claim: RunClaim | None = None  # this run's id and the checkpoint it resumes from (run_folder.py)
        self.state: Run | None = None
        self.log: MetricsLogger | None = None
        self.trainer = self.generator = self.buffer = self.reward = self.dataset = self.reference = None
        self._stack: contextlib.AsyncExitStack | None = None
        self._rollouts: list[asyncio.Task] = []
        self._pending_update: asyncio.Task | None = None  # the generators' swap to the newest version
        self._step_task: asyncio.Future | None = None
        self._started: float | None = None  # the training clock: from the first step (evaluations move it on)
        self._stopped: float | None = None  # ... to the end of the last step
        self._gen_busy_start = self._eval_busy_s = self._occupancy = 0.0
        self._gen_at_start: dict = {}
        self._checkpointed: tuple[int, Path] | None = None  # (step, path) of the last checkpoint this run wrote
        self._reference_version = 0  # the policy version the reference's weights are (reference.follow_every)
        self._reference_follow: asyncio.Task | None = None  # its load of a newer one, started after a publish
        self.timeline = Timeline()  # each role's busy spans: output_dir/timeline.{json,png}

    @property
    def step(self) -> int:
        """Training steps taken (= the policy version; a resumed run starts at its checkpoint's)."""
        return self.state.version if self.state else 0

    def reference_model(self) -> str | None:
        """Whose logprobs fill TrainBatch.ref_logprobs every step: the starting policy when the KL penalty needs
        it (trainer.grpo.kl_coef > 0); a distillation run returns its teacher."""
        return self.cfg.trainer.model if self.cfg.trainer.grpo.kl_coef > 0 else None

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

    # ---- start ----------------------------------------------------------------------------------------

    async def start(self) -> "GRPORun":
        """Check the config and the task, place the roles, start every actor, resume when asked to."""
        self.prepare()
        self._stack = contextlib.AsyncExitStack()
        try:
            cfg = self.cfg
            if cfg.launcher.kind == "slurm":
                self.console.print(f"[bold]{self.algorithm()}[/bold] on Slurm: waiting for {cfg.launcher.slurm.trainer_nodes} "
                                   f"trainer + {cfg.launcher.slurm.generator_nodes} generator nodes")
            hosts, self.provisioner = await self._stack.enter_async_context(
                run_hosts(cfg.launcher, self.out, self.log_dir))
            self.console.print(f"[bold]{self.algorithm()}[/bold] {cfg.model}: starting actors (vLLM engine start takes ~30 s on CPU)")
            if self.log_dir:
                self.console.print(f"the role processes' logs (vLLM, TorchTitan, Monarch) go to {self.log_dir}/ "
                                   "(--verbose: here)")
            gpus = self._place(hosts)
            await self._start_actors(hosts, gpus)
            await self._resume()
        except BaseException:
            await self.stop()
            raise
        return self

    def prepare(self) -> None:
        """Everything that needs no actor: config checks, the model's path, the task's data, the output directory
        (claimed for this run, or refused) and the checkpoint to resume from (verified)."""
        cfg = self.cfg
        if not cfg.async_mode and cfg.max_policy_age != 0:
            self.console.print("[yellow]async_mode: false runs a synchronous loop; max_policy_age is set to 0[/yellow]")
            cfg.max_policy_age = 0
        check_config(cfg)
        if self.group_advantages():
            check_group_size(cfg, self.algorithm())
        self.model_dir = model_path(cfg.model)
        check_moe(cfg, self.model_dir)
        cfg.trainer.model = self.model_dir
        cfg.trainer.profile_dir = str(self.out / "profile")  # trainer.profile_steps' traces, one per rank and window
        rows = check_task(cfg)  # before the tokenizer: importing transformers takes seconds
        self.tokenizer = load_tokenizer(self.model_dir)
        check_prompt_lengths(cfg, rows, self.tokenizer, self.model_dir)
        self.claim = claim_output_dir(self.out, self.checkpoint_dir, algorithm=self.algorithm().lower(),
                                      resume=cfg.resume, overwrite=cfg.overwrite, steps=cfg.steps,
                                      export_dir=cfg.export_dir)
        for note in self.claim.notes:
            self.console.print(f"[yellow]{note}[/yellow]")
        (self.out / "config.yaml").write_text(to_yaml(cfg))
        self.buffer_cfg = ReplayBufferConfig(**asdict(cfg.buffer), max_policy_age=cfg.max_policy_age,
                                             dp_size=dp_size(cfg), pad_id=self.tokenizer.pad_token_id or 0,
                                             seed=cfg.seed, temperature=cfg.trainer.temperature)
        self.state = Run(cfg)

    def _place(self, hosts: dict) -> list[str]:
        """Where each role runs (self.placement); returns the GPUs the trainer's ranks take."""
        cfg = self.cfg
        tp = int(cfg.generator.engine_args.get("tensor_parallel_size", 1))
        if hosts:  # every role on hosts of its own: GPUs per node from the launcher, cores not pinned
            node_gpus = cfg.launcher.slurm.gpus_per_node or 0
            self.placement = host_placement(cfg.launcher, node_gpus)
            gpus = [str(i) for i in range(node_gpus)]
        else:
            gpus = visible_gpus()  # one GPU per trainer rank; a generator replica gets one per TP rank
            self.placement = plan_placement(cfg.resources, cfg.trainer_procs, cfg.generator.replicas,
                                            tp if gpus else 0, gpus)
            plan_reward_models(cfg.resources, self.placement, sum(r.model is not None for r in cfg.rewards))
        self.generator_gpus = tp if gpus else 0
        # a trainer that time-shares its GPU with an engine gives the step's cached memory back for its wake-up
        cfg.trainer.release_memory_after_step = self.placement.colocated and self.placement.device == "cuda"
        self.console.print(self.placement.describe())
        return gpus

    async def _start_actors(self, hosts: dict, gpus: list[str]) -> None:
        cfg, placement = self.cfg, self.placement
        # Generators on other hosts than the trainer copy each version from the trainer's host (Monarch RDMA).
        weight_source = await weight_server(cfg.weight_store) if hosts else None
        shared = placement.colocated and placement.device == "cuda"
        engine_args = self._engine_args(shared)
        # The placement plan's GPUs, pinned as planned: the trainer's ranks one each, each replica its own set.
        trainer_cpus = dict(cpus=_tuples(placement.trainer_cpus), threads=placement.trainer_threads,
                            gpu_ids=_tuples([placement.trainer_gpus] if placement.trainer_gpus else []))
        reward_models = await self._start_reward_models()
        self.trainer, self.generator, self.buffer, self.reward, self.dataset = await asyncio.gather(
            Trainer.options(procs=cfg.trainer_procs, spmd=True, gpus=bool(gpus), share_gpus=shared,
                            host_mesh="trainer", **trainer_cpus).as_actor(cfg.trainer, cfg.weight_store),
            Generator.options(replicas=cfg.generator.replicas, gpus=self.generator_gpus, share_gpus=shared,
                              host_mesh="generator", cpus=_tuples(placement.generator_cpus),
                              gpu_ids=_tuples(placement.generator_gpus)).as_service(
                self.model_dir, engine_args=engine_args, sampling=cfg.generator.sampling, seed=cfg.seed,
                swap_mode=cfg.generator.swap_mode, weight_store=cfg.weight_store, weight_source=weight_source,
                log_level=cfg.generator.log_level, lora=cfg.trainer.lora, max_kept_tokens=cfg.generator.max_kept_tokens,
                record_routes=cfg.trainer.keep_routing,  # Keep Routing: the trainer replays the engine's experts
            ),
            ReplayBuffer.as_actor(self.buffer_cfg),
            RewardActor.as_actor(cfg.rewards, cfg.reward_timeout_s, cfg.reward_workers, cfg.reward_memory_mb,
                                 reward_models),
            PromptDataset.as_actor(cfg.task, self.model_dir, cfg.seed, max_prompt_tokens(cfg, self.model_dir),
                                   cfg.chat_template_kwargs),
        )
        reference = self.reference_model()
        if reference is not None:  # a frozen policy (or a teacher), on the trainer's cores
            self.reference = await Reference.options(
                procs=cfg.trainer_procs, spmd=True, gpus=bool(gpus), share_gpus=True, host_mesh="trainer",
                **trainer_cpus).as_actor(
                    # the policy's routes replay in the policy's own model only, not in a distillation teacher's
                    replace(cfg.trainer, model=reference,
                            keep_routing=cfg.trainer.keep_routing and reference == cfg.trainer.model),
                    cfg.weight_store, weight_source)
        self.shards = {"trainer": await data_shards(self.trainer)}  # rank -> the batch it trains on
        if self.reference is not None:
            self.shards["reference"] = await data_shards(self.reference)
        self.held_out = await self.dataset.held_out.call_one(cfg.eval_size)
        if not self.held_out:
            self.console.print("[yellow]eval_size=0: no held-out evaluations[/yellow]" if not cfg.eval_size else
                               "[yellow]the task has no held-out set (task.held_out, task.held_out_fraction): "
                               "no evaluations[/yellow]")

    async def _start_reward_models(self) -> dict:
        """Each reward model of `rewards` on procs of its own (forge_rl/actors/reward_model.py): a classifier's
        RewardModel actor, or a judge's vLLM Generator (greedy, one replica, on its own rewards[i].engine_args with
        TP 1, and no weight store: it serves its own checkpoint). Name -> actor, for the reward actor."""
        models = {}
        for spec in (s for s in self.cfg.rewards if s.model is not None):
            options = self._reward_model_options(len(models))
            if spec.kind == "classifier":
                models[spec.name] = await RewardModel.options(mesh_name=f"RewardModel-{len(models)}",
                                                              **options).as_actor(
                    spec.model, spec.max_batch, spec.batch_window_ms)
            else:
                models[spec.name] = await Generator.options(mesh_name=f"Judge-{len(models)}", **options).as_actor(
                    resolve_model_path(spec.model), engine_args=judge_engine_args(spec),
                    sampling=dict(temperature=0.0, max_tokens=spec.max_tokens), seed=self.cfg.seed,
                    policy_weights=False, log_level=self.cfg.generator.log_level,
                    engine_args_key=f"rewards[{self.cfg.rewards.index(spec)}].engine_args")
            self.console.print(f"reward model {spec.name} ({spec.kind}, {spec.model}) started")
        return models

    def _reward_model_options(self, i: int) -> dict:
        """The i-th reward model's procs as the placement planned them (resources.reward_model_cpus / _gpus): its
        cores, or its GPU (time-shared, as another role may use it too). On a launcher's hosts: the controller's."""
        cpus, gpus = self.placement.reward_model_cpus, self.placement.reward_model_gpus
        if gpus:
            return dict(gpus=len(gpus[i]), gpu_ids=(tuple(gpus[i]),), share_gpus=True, host_mesh="reward_model")
        return dict(cpus=(tuple(cpus[i]),) if cpus else (), host_mesh="reward_model")

    def _engine_args(self, shared: bool) -> dict:
        """The generators' vLLM engine args. Colocated on GPUs: sleep mode (the engine sleeps while the trainer
        steps), and gpu_memory_utilization from the memory plan unless the user set it (then checked against it)."""
        engine_args = dict(self.cfg.generator.engine_args)
        if not shared:
            return engine_args
        engine_args.setdefault("enable_sleep_mode", True)
        if (plan := self._memory_plan(engine_args)) is not None:
            self.console.print(plan.describe())
            plan.check(engine_args.get("gpu_memory_utilization"))  # a ConfigError with the numbers
            engine_args.setdefault("gpu_memory_utilization", plan.gpu_memory_utilization)
        return engine_args

    def _memory_plan(self, engine_args: dict):
        """The plan of one colocated GPU (forge_rl/runtime/memory_plan.py); None when the model's config.json
        has no dense decoder's shape."""
        cfg = self.cfg
        try:
            shape = ModelShape.from_config(self.model_dir, name=Path(cfg.model).name)
            ref = self.reference_model()
            ref_params = ModelShape.from_config(resolve_model_path(ref)).parameters() if ref else 0
        except (OSError, ValueError) as e:
            self.console.print(f"[yellow]no memory plan for the colocated GPUs: {e}[/yellow]")
            return None
        seq_len = engine_args.get("max_model_len") or shape.max_position_embeddings or 2048
        return plan_memory(
            shape, gpu_total_bytes(self.placement.gpus[0]), trainer_ranks=cfg.trainer_procs,
            micro_batch=cfg.trainer.micro_batch_size or -(-cfg.batch_groups * cfg.group_size // dp_size(cfg)),
            seq_len=seq_len, activation_checkpointing=cfg.trainer.parallel.activation_checkpointing,
            fused_lm_head=cfg.trainer.fused_lm_head, trainer_tp=cfg.trainer.parallel.tp,
            trainer_ep=cfg.trainer.parallel.ep, lora=cfg.trainer.lora.enabled, reference_params=ref_params,
            **({"lm_head_memory_gb": cfg.trainer.lm_head_memory_mb * 2**20 / 1e9} if cfg.trainer.lm_head_memory_mb
               else {}),
            critic_params=self.critic_parameters(),
            engine_dtype=engine_args.get("dtype", "bfloat16"), tensor_parallel_size=self.generator_gpus,
            max_model_len=engine_args.get("max_model_len"), max_num_seqs=engine_args.get("max_num_seqs"))

    async def _resume(self) -> None:
        cfg, path = self.cfg, self.claim.resume_from
        if path is not None:  # chosen and verified by claim_output_dir, before any actor started
            self.start_step = await resume_from_checkpoint(self.state, self.trainer, self.generator, self.buffer,
                                                           self.dataset, path, self.other_trained())
            self.saved_step = self.start_step
            self.console.print(f"resumed from {path} at step {self.start_step} (policy version {self.state.version}, "
                               f"run {self.claim.run_id})")
        self.log = MetricsLogger(self.out, cfg.wandb_project, config=asdict(cfg),
                                 resume_step=self.start_step if path is not None else None)

    # ---- the steps ------------------------------------------------------------------------------------

    async def evaluate(self) -> dict[str, float]:
        """Greedy held-out evaluation of the generators' newest weights, logged at the current step. Rollouts
        wait meanwhile, and the time is not counted as training time."""
        t0, at_s = time.perf_counter(), self.training_s()
        if self._pending_update is not None:  # the generators first take the newest version
            self.state.last_updates, self._pending_update = await self._pending_update, None
        await self.state.admission.pause()
        try:
            with self.timeline.span("generators", "evaluate", step=self.step):
                scores = await self._evaluate_held_out()
        finally:
            await self.state.admission.pause(False)
        self.evals.append((self.step, at_s, scores["eval/accuracy"]))
        self.log.log(self.step, scores)
        if self._started is not None and self._stopped is None:  # evaluations are not training time
            self._eval_busy_s += time.perf_counter() - t0
            self._started += time.perf_counter() - t0
        return scores

    async def train_step(self) -> dict[str, float]:
        """One training step: sample a batch at the current policy version, train on it, publish version + 1 and
        swap the generators to it (in async mode the swap runs on while the next step samples). Returns the
        step's metrics line, also logged."""
        s = self.state
        if not self._rollouts:
            await self._start_rollouts()
        step_start, tokens_before = time.perf_counter(), s.rollouts.generated_tokens
        buffer_before = await self.buffer.stats.call_one()
        with self.timeline.span("controller", "wait for a batch", step=s.version + 1):
            batches, sample_wait = await wait_for_batch(s, self.buffer, self._rollouts)
        # the next batch is sampled at version + 1: admit only what that batch can still use
        stored = s.admission.stored
        await s.admission.sampled((await self.buffer.stats.call_one())["groups"], s.version + 1, stored)
        staleness, oldest = batch_staleness(batches, s.version)
        s.max_staleness = max(s.max_staleness, oldest)
        metrics, push = await self._train_and_publish(batches)
        s.staleness_sum, s.staleness_steps = s.staleness_sum + staleness, s.staleness_steps + 1
        s.mismatch.append((metrics["mismatch_abs_mean"], metrics["mismatch_abs_max"]))
        await self._swap_generators()
        raise_if_failed(self._rollouts)
        buffer, data = await self.buffer.stats.call_one(), await self.dataset.stats.call_one()
        rewards, parts = s.rollouts.take_rewards()
        line = step_metrics(StepRecord(
            step=self.step, trainer=metrics, push=push, updates=s.last_updates, buffer=buffer,
            buffer_before=buffer_before, staleness=staleness, max_staleness=s.max_staleness,
            sample_wait_s=sample_wait, step_s=time.perf_counter() - step_start,
            generated_tokens=s.rollouts.generated_tokens - tokens_before,
            generator=await self.generator.stats.route(), data=data, drops=drops(buffer, s.drops, data),
            rewards=rewards, reward_parts=parts, batch_rewards=batch_rewards(batches),
        ))
        line.update({k: v for k, v in metrics.items() if "/" in k})  # another stage's, named (PPO's critic/...)
        self.log.log(self.step, line)
        self.timeline.mark(f"step {self.step}")
        return line

    async def checkpoint(self) -> Path:
        """The trainer's DCP checkpoint plus the buffer, the data position and the counters, as step-N. Every
        rollout started lands in the buffer first, so the checkpoint holds it."""
        if self._checkpointed is not None and self._checkpointed[0] == self.step:
            return self._checkpointed[1]  # e.g. the last step on the checkpoint_every schedule, then finish()
        if self._rollouts and not await self.state.admission.quiesce(timeout_s=60):
            self.console.print("[yellow]checkpoint: rollouts still in flight after 60 s; their prompts are "
                               "skipped on resume[/yellow]")
        try:
            with self.timeline.span("trainer", "checkpoint", step=self.step):
                path = await self._save()
        finally:
            await self.state.admission.pause(False)
        return path

    async def _save(self) -> Path:
        path = await save_checkpoint(self.state, self.trainer, self.buffer, self.dataset, self.step,
                                     self.checkpoint_dir, self.cfg.checkpoint_keep_last, self.other_trained(),
                                     run_id=self.claim.run_id)
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
            self.console.print(f"[yellow]interrupted at step {self.step}: nothing trained since {since}, "
                               "so no checkpoint is written[/yellow]")
            return None
        self.console.print(f"[yellow]interrupted at step {self.step}: saving a final checkpoint[/yellow]")
        await self.state.admission.quiesce(timeout_s=10)
        await self._stop_rollouts()
        return await self._save()

    async def finish(self) -> dict:
        """End of training: the generators take the final weights, a last evaluation, a checkpoint, the HF
        export; writes summary.json and curves.png and prints where everything is. Returns the summary. The
        rollouts in flight land in the buffer first, so the final checkpoint holds them (as every checkpoint)."""
        cfg = self.cfg
        await self._land_rollouts()
        if self._pending_update is not None:
            self.state.last_updates, self._pending_update = await self._pending_update, None
        self._stopped = time.perf_counter()
        wall = self.training_s()
        # A replica respawning now (it died late in the run) joins the final evaluation with the final weights.
        if not await self.generator.wait_healthy(timeout_s=300):
            self.console.print("[yellow]a generator replica is still down after 300 s; evaluating without it[/yellow]")
        await update_generators(self.state, self.generator, self.state.version, cfg.timeouts.weight_load_s,
                                self._where())
        gen_stats = await self.generator.stats.route()
        gen_busy_s = gen_stats["busy_s"] - self._gen_busy_start - self._eval_busy_s
        self._occupancy = occupancy(self._gen_at_start, gen_stats)
        if self.step > self.start_step or not self.evals:  # none yet: finish() right after start() (a notebook)
            await self.evaluate()
        checkpoint = await self.checkpoint()
        if cfg.export_dir:
            await self.trainer.export_hf.call(cfg.export_dir)  # with LoRA: merged into the base
            if cfg.trainer.lora.enabled:  # and the adapter alone, as PEFT saves one
                await self.trainer.export_adapter.call(str(Path(cfg.export_dir) / "adapter"))
        summary = dict(await self._summary(wall, gen_busy_s), run_id=self.claim.run_id, checkpoint=str(checkpoint))
        summary["busy_fraction"] = {lane: round(f, 3) for lane, f in self.timeline.role_busy_fractions().items()}
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2))
        png = plot_run(self.out / "metrics.jsonl", self.out / "curves.png", title=f"{self.algorithm()} {cfg.model}")
        self.timeline.write(self.out)
        self.console.print(summary_block(summary, self.eval_reward_name(), self.out, png,
                                         checkpoint, cfg.export_dir,
                                         cfg.trainer.lora.enabled, self.log_dir))
        return summary

    async def stop(self) -> None:
        """Stop the rollouts, every actor and proc of the run, and remove its shared memory (idempotent)."""
        await self._stop_rollouts()
        if self.timeline.spans and self.out.is_dir():  # an interrupted run's too
            self.timeline.write(self.out)
        if self._reference_follow is not None:  # a load started after the last publish: nobody scores with it
            self._reference_follow.cancel()
            await asyncio.gather(self._reference_follow, return_exceptions=True)
            self._reference_follow = None
        if self.log is not None:
            self.log.close()
            self.log = None
        if self._stack is not None:
            stack, self._stack = self._stack, None
            await asyncio.shield(stack.aclose())

    async def __aenter__(self) -> "GRPORun":
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    def _where(self) -> str:
        """For a timeout's message: where the roles run, their logs, and where to resume."""
        cfg = self.cfg
        hosts = (f"the roles run on Slurm job nodes (trainer: {cfg.launcher.slurm.trainer_nodes}, generators: "
                 f"{cfg.launcher.slurm.generator_nodes})" if cfg.launcher.kind == "slurm"
                 else f"the roles run on host {socket.gethostname()}")
        logs = f", their output in {self.log_dir}/" if self.log_dir else ""
        return f"{hosts}{logs}; {resume_hint(self.checkpoint_dir, self.claim.run_id if self.claim else None)}"

    def role_died(self, error: BaseException):
        """The error a dead role's SupervisionError becomes: the role, its logs and the checkpoint to resume from."""
        return role_died(error, self.checkpoint_dir, self.log_dir, self.claim.run_id if self.claim else None)

    def training_s(self) -> float:
        """Seconds of training so far: from the first step on, start-up and evaluations excluded."""
        if self._started is None:
            return 0.0
        return (self._stopped or time.perf_counter()) - self._started

    def eval_reward_name(self) -> str:
        if self.cfg.env.name is not None:
            return f"solved within {self.cfg.env.max_turns} turns ({self.cfg.env.name})"
        return self.cfg.task.eval_reward or self.cfg.rewards[0].name

    # ---- inside the steps -----------------------------------------------------------------------------

    async def _start_rollouts(self) -> None:
        """Rollout tasks in this controller, as many as admission allows: prompt -> G completions -> rewards ->
        advantages -> buffer. Synchronous: the whole batch is generated at once."""
        cfg = self.cfg
        actors = dict(dataset=self.dataset, generator=self.generator, buffer=self.buffer, group_size=cfg.group_size,
                      stats=self.state.rollouts, scale_advantages_by_std=cfg.scale_advantages_by_std)
        max_tokens = cfg.generator.sampling.get("max_tokens", 16)
        if cfg.env.name is None:
            single = dict(lengths=LengthDraws(cfg.generator.lengths, max_tokens) if cfg.generator.lengths.enabled
                          else None, max_age=cfg.max_policy_age if cfg.stale_in_flight == "requeue" else None)

            def rollout_once():
                return rollout_from_dataset(reward=self.reward, overlong=cfg.overlong, max_tokens=max_tokens,
                                            **single, **actors)
        else:
            turns = dict(make_env=env_factory(cfg.env, cfg), env_cfg=cfg.env, max_tokens=max_tokens,
                         renderer=TurnRenderer(self.tokenizer, **cfg.chat_template_kwargs))

            def rollout_once():
                return rollout_env_from_dataset(**turns, **actors)
        tasks = cfg.rollout_tasks if cfg.async_mode else max(cfg.rollout_tasks, cfg.batch_groups)
        self._gen_at_start = await self.generator.stats.route()
        self._gen_busy_start = self._gen_at_start["busy_s"]
        def timed(lane: str):
            return lambda: self._timed(lane, "rollout", rollout_once())

        self._rollouts = [asyncio.create_task(rollout_loop(self.state.admission, self.state.stop, timed(f"rollout {i}")))
                          for i in range(tasks)]
        self._started = time.perf_counter()

    async def _train_and_publish(self, batches) -> tuple[dict, dict]:
        """train_step + push_weights, shielded: an interrupt lets the step finish (see save_on_interrupt)."""
        s = self.state
        if self.placement.colocated:  # the trainer gets the device: the generators step aside (GPU: sleep)
            if self._pending_update is not None:
                s.last_updates, self._pending_update = await self._pending_update, None
            hold_s = max(await self.generator.hold.call_all(), default=0.0)
        busy_start = time.perf_counter()
        reference_version = await self._reference_caught_up()
        self._step_task = asyncio.ensure_future(self._timed(
            "trainer", "score + train + publish", self._update(batches), step=s.version + 1))
        metrics, push = await asyncio.shield(self._step_task)
        s.trainer_busy_s += time.perf_counter() - busy_start
        if reference_version is not None:  # the version whose logprobs this step's batch was scored with
            metrics = {**metrics, "reference/version": reference_version}
        self._follow_policy()
        if self.placement.colocated:  # ... and take it back (GPU: wake up)
            push = dict(push, hold_s=hold_s, release_s=max(await self.generator.release.call_all(), default=0.0))
        return metrics, push

    async def _timed(self, lane: str, name: str, work, **args):
        """Await `work` as a busy span of `lane` on the run's timeline."""
        with self.timeline.span(lane, name, **args):
            return await work

    async def _reference_caught_up(self) -> int | None:
        """The policy version the reference scores with (None: no reference), once its pending load is done."""
        if self._reference_follow is not None:
            task, self._reference_follow = self._reference_follow, None
            self._reference_version = (await task).get(0)
        return self._reference_version if self.reference is not None else None

    def _follow_policy(self) -> None:
        """reference.follow_every: every M steps, right after the publish, the reference starts loading the policy's
        version step - follow_lag from the weight store; generation and training go on meanwhile."""
        every, target = self.cfg.reference.follow_every, self.step - self.cfg.reference.follow_lag
        if self.reference is None or not every or self.step % every or target <= self._reference_version:
            return
        self._reference_follow = asyncio.create_task(within(
            self.reference.follow.call(target), self.cfg.timeouts.weight_load_s, "weight_load_s",
            f"the Reference's load of policy version {target}", self._where()))

    async def _update(self, batches) -> tuple[dict, dict]:
        """What a step does with its batch: the policy's optimizer step and the publish of its weights. Returns
        the trainer's metrics (keys with a '/' go into the step's line as they are) and the push record."""
        return await train_and_publish(self.state, self.trainer, self.reference, batches, self.shards,
                                       self.cfg.timeouts, self._where())

    async def _swap_generators(self) -> None:
        """Every replica prefetches the new version and swaps between engine steps; one swap at a time, in
        version order. Synchronous mode waits for it."""
        s = self.state
        if self._pending_update is not None:
            s.last_updates = await self._pending_update
        self._pending_update = asyncio.create_task(self._timed(
            "generators", "weight swap", update_generators(s, self.generator, s.version, self.cfg.timeouts.weight_load_s,
                                                           self._where()), version=s.version))
        if not self.cfg.async_mode:
            s.last_updates, self._pending_update = await self._pending_update, None

    async def _land_rollouts(self) -> None:
        """Stop admitting rollouts, let those in flight put their groups in the buffer (60 s at most), then stop
        the rollout tasks."""
        if self._rollouts and not await self.state.admission.quiesce(timeout_s=60):
            self.console.print("[yellow]finish: rollouts still in flight after 60 s; their prompts are skipped on "
                               "resume[/yellow]")
        await self._stop_rollouts()

    async def _stop_rollouts(self) -> None:
        if self.state is not None:
            self.state.stop.set()
        for t in self._rollouts:
            t.cancel()
        await asyncio.gather(*self._rollouts, return_exceptions=True)
        self._rollouts = []

    async def _evaluate_held_out(self) -> dict[str, float]:
        """`eval/accuracy`: the mean of the eval reward over the held-out examples, greedy (NaN when the task has
        none); with an environment, the fraction solved within env.max_turns, and `eval/first_turn`."""
        cfg = self.cfg
        if not self.held_out:
            return {"eval/accuracy": float("nan")}
        max_tokens = cfg.generator.sampling.get("max_tokens", 8)
        if cfg.env.name is not None:  # solved within env.max_turns, greedy
            renderer = TurnRenderer(self.tokenizer, **cfg.chat_template_kwargs)
            result = await evaluate_env(self.generator, self.held_out, env_factory(cfg.env, cfg), renderer, cfg.env,
                                        max_tokens)
            return {"eval/accuracy": result["accuracy"], "eval/first_turn": result["first_turn"]}
        result = await evaluate_task(self.generator, self.reward, self.held_out, self.eval_reward_name(),
                                     max_tokens=max_tokens)
        return {"eval/accuracy": result["accuracy"]}

    async def _summary(self, wall: float, gen_busy_s: float) -> dict:
        s = self.state
        final_buffer = await self.buffer.evict.call_one()
        data = await self.dataset.stats.call_one()
        last3 = [acc for *_, acc in self.evals[-3:]]
        generated = final_buffer["added"] + sum(n for k, n in s.drops.items() if k.startswith("reward_"))
        done = self.step - self.start_step
        return dict(
            steps=self.step, start_step=self.start_step, wall_s=wall, steps_per_min=done / wall * 60 if wall else 0.0,
            eval_first=self.evals[0][2] if self.evals else None,
            eval_last3_mean=statistics.mean(last3) if last3 else None, evals=self.evals,
            time_to_60=next((t for _, t, acc in self.evals if acc >= 0.6), None),
            generator_version=await self.generator.version.route(),
            generator_versions=await self.generator.version.call_all(),  # every replica, respawned ones included
            trainer_version=s.version, generator_respawns=self.generator.service_stats.respawns,
            max_staleness=s.max_staleness, mean_staleness=s.staleness_sum / max(s.staleness_steps, 1),
            mismatch_abs_mean=statistics.mean(m for m, _ in s.mismatch) if s.mismatch else None,
            mismatch_abs_max=max((x for _, x in s.mismatch), default=None),
            trainer_idle_fraction=1 - s.trainer_busy_s / wall if wall else 0.0,
            generator_idle_fraction=1 - gen_busy_s / wall if wall else 0.0,
            generator_stats=await self.generator.stats.route(), admission_wait_s=s.admission.wait_s,
            placement=self.placement.describe(), stale_fraction=final_buffer["dropped"]["stale"] / max(generated, 1),
            mean_running_sequences=self._occupancy, partial_rollouts=s.rollouts.partial_rollouts(),
            buffer=final_buffer, drops=drops(final_buffer, s.drops, data), data=data,
        )


async def train_and_publish(state: Run, trainer, reference, batches, shards: dict[str, list[int]],
                            timeouts: TimeoutsConfig | None = None, where: str = "") -> tuple[dict, dict]:
    """One optimizer step, its weights published, the run's policy version advanced. It runs to the end even when
    the run is interrupted, so a final checkpoint never holds a trainer one step ahead of the run's version,
    buffer and data position. Each rank is sent its own data-parallel batch only (`shards`: each role's rank ->
    shard), and each call has its timeout (timeouts.*): a hung rank stops the run, named."""
    t = timeouts or TimeoutsConfig()
    batches = await fill_reference(reference, batches, shards, state.version + 1, t, where)
    metrics = await train_policy(trainer, batches, shards, state.version + 1, t, where)
    push = await publish(state, trainer, t, where)
    return metrics, push


async def fill_reference(reference, batches, shards: dict[str, list[int]], version: int, t: TimeoutsConfig,
                         where: str) -> list:
    """`batches` with ref_logprobs from the frozen reference policy (or a distillation teacher); as they are
    without one."""
    if reference is None:
        return batches
    filled = await within(call_each_rank(reference, "fill_ref_logprobs", batches_for_ranks(batches, shards["reference"])),
                          t.reference_s, "reference_s", f"the Reference's fill_ref_logprobs for version {version}",
                          where)
    return [filled[shards["reference"].index(i)][i] for i in range(len(batches))]


async def train_policy(trainer, batches, shards: dict[str, list[int]], version: int, t: TimeoutsConfig,
                       where: str) -> dict:
    """The Trainer's optimizer step to `version` on `batches`; its metrics (rank 0's, reduced over ranks)."""
    return (await within(call_each_rank(trainer, "train_step", batches_for_ranks(batches, shards["trainer"])),
                         t.train_step_s, "train_step_s", f"the Trainer's train_step to version {version}", where))[0]


async def publish(state: Run, trainer, t: TimeoutsConfig, where: str) -> dict:
    """Publish the trained weights as the next version and advance the run's policy version to it."""
    version = state.version + 1
    push = (await within(trainer.push_weights.call(version), t.publish_s, "publish_s",
                         f"the Trainer's push_weights of version {version}", where)).get(0)
    state.version = version
    return push


def occupancy(before: dict, after: dict) -> float:
    """The engine's mean batch occupancy between two Generator.stats of one replica: sequences in it (running or
    queued), averaged over the time it generated (evaluations in between included)."""
    if not before:  # no rollout started
        return 0.0
    busy = after["busy_s"] - before["busy_s"]
    return (after["sequence_s"] - before["sequence_s"]) / busy if busy > 0 else 0.0


def host_placement(launcher: LauncherConfig, node_gpus: int) -> Placement:
    """Roles on hosts of their own (a Slurm allocation): nothing to share, nothing to pin."""
    s = launcher.slurm
    where = f"{node_gpus} GPUs per node" if node_gpus else "CPU"
    return Placement("disaggregated", "cuda" if node_gpus else "cpu",
                     note=f"trainer on {s.trainer_nodes} node(s), generators on {s.generator_nodes} node(s), {where}")


def _tuples(lists: list[list[int]]) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(x) for x in lists)


async def train(run: GRPORun) -> dict:
    """The loop `make demo` runs: evaluate, then train step by step with evaluations and checkpoints on their
    schedule, then finish. An interrupt (in the first evaluation too) saves a final checkpoint when anything was
    trained since the last; a dead role becomes an error naming it."""
    try:
        async with run:
            try:
                if run.held_out:
                    run.console.print(f"evaluating step {run.step} on {len(run.held_out)} held-out prompts ...")
                accuracy = (await run.evaluate())["eval/accuracy"]
                if run.held_out:  # none: said at start, and not as "nan%"
                    run.console.print(f"held-out greedy accuracy at step {run.step}: {accuracy:.1%} "
                                      f"({len(run.held_out)} prompts, {run.eval_reward_name()})")
                await train_steps(run)
            except (KeyboardInterrupt, asyncio.CancelledError):
                await run.save_on_interrupt()
                raise
            return await run.finish()
    except SupervisionError as e:  # a role's process died: name it and the checkpoint to resume from
        raise run.role_died(e) from e
    except RewardRoleDied as e:  # a reward model's or judge's process died (the reward actor names it)
        raise RoleDied(f"{e}; {resume_hint(run.checkpoint_dir, run.claim.run_id if run.claim else None)}") from e


async def train_steps(run: GRPORun) -> None:
    """Steps up to cfg.steps, each with its evaluation and checkpoint when they are due."""
    cfg = run.cfg
    # no bar without a terminal (nohup, CI, a batch step): the step lines say it all
    with tqdm(total=cfg.steps, initial=run.step, desc="GRPO steps", unit="step", dynamic_ncols=True,
              disable=None) as bar:
        while run.step < cfg.steps:
            line = await run.train_step()
            if cfg.eval_every and run.step % cfg.eval_every == 0 and run.step != cfg.steps:
                line.update(await run.evaluate())
            if cfg.checkpoint_every and run.step % cfg.checkpoint_every == 0:
                await run.checkpoint()
            bar.update(1)
            bar.set_postfix(reward=shown_reward(line), acc=f"{run.evals[-1][2]:.0%}")
            tqdm.write(console_line(run.step, line))
            if "profile/summary" in line:  # trainer.profile_steps: the window's top operators, rank 0's
                tqdm.write(line["profile/summary"])


CONFIG = GRPOConfig  # what the command line and `forge_rl.launch submit --recipe grpo` read


async def main(cfg: GRPOConfig) -> dict:
    return await train(GRPORun(cfg))
