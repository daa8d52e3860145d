"""Supervised fine-tuning: prompts + target responses -> cross-entropy on the response tokens, on the
TorchTitan trainer actor (FSDP2 / TP over the procs given), with greedy held-out evaluation of a task through
a vLLM generator service, scored by the task's rewards as GRPO scores it.

    summary = await train(SFTRun(cfg))    # forge_rl/recipes/train.py: the loop every run shares
    run = SFTRun(cfg)             # or step by step: cfg is an SFTConfig
    await run.start()             # trainer (and resume)
    metrics = await sft_step(run.roles, run.step_state, SFT)    # forge_rl/recipes/sft_step.py
    await run.evaluate()          # the first one starts a generator on an export; later ones push weights into it
    await run.checkpoint()
    summary = await run.finish()
    await run.stop()

Data: `dataset: arithmetic` generates "a+b=" -> "c" problems in code (held-out questions excluded); or a
path to a local .jsonl file or HF dataset directory (forge_rl/data/jsonl.py, docs/sft.md). Outputs in
output_dir: config.yaml, metrics.jsonl, loss.png, summary.json, timeline.json and timeline.png (what each role did
when); DCP checkpoints in trainer.checkpoint_dir
(resume=true continues from the newest intact one; output_dir belongs to one run: docs/sft.md); an HF
export in export_dir at the end.
"""

import asyncio
import json
import math
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.table import Table
from tqdm import tqdm

from forge_rl.actors.reward import RewardActor
from forge_rl.actors.trainer import Trainer
from forge_rl.config import ConfigError
from forge_rl.launch.launcher import weight_server
from forge_rl.runtime.provisioner import visible_gpus
from forge_rl.data.sft_sources import make_source
from forge_rl.data.task import TaskRows, check_prompts_fit, render
from forge_rl.deps.vllm import check_engine_args
from forge_rl.errors import UserError
from forge_rl.loop.checkpoint import commit_checkpoint
from forge_rl.loop.eval import evaluate_task
from forge_rl.models import load_tokenizer, model_path
from forge_rl.observability import MetricsLogger, plot_run
from forge_rl.observability.plots import SFT_PANELS
from forge_rl.recipes import run_config
from forge_rl.recipes.run import RecipeRun
from forge_rl.recipes.grpo_config import GeneratorConfig
from forge_rl.recipes.sft_config import SFTConfig, eval_max_tokens
from forge_rl.recipes.sft_step import SFTRoles, SFTState, sft_step
from forge_rl.recipes.train import train
from forge_rl.loop.ranks import Ranks
from forge_rl.recipes.algorithm import Algorithm


def dp_size(cfg: SFTConfig) -> int:
    """The trainer's data-parallel size, which must divide batch_size (each rank takes an equal share)."""
    return run_config.dp_size(cfg, "batch_size")


def check_eval_generator(generator: GeneratorConfig) -> None:
    """SFT's generator only evaluates (greedy, one replica): a setting it would not use is refused, not ignored."""
    unused = [
        f"generator.{k}"
        for k, v in vars(generator).items()
        if k not in ("engine_args", "sampling") and v != getattr(GeneratorConfig(), k)
    ]
    unused += [f"generator.sampling.{k}" for k in generator.sampling if k != "max_tokens"]
    if unused:
        raise ConfigError(
            f"{', '.join(unused)}: SFT's evaluation reads only generator.engine_args and "
            "generator.sampling.max_tokens (greedy, one replica); remove the rest"
        )


def check_config(cfg: SFTConfig) -> None:
    if cfg.trainer.model not in ("tiny", cfg.model):
        raise ConfigError(f"set the model with `model`, not trainer.model ({cfg.trainer.model!r})")
    check_engine_args(cfg.generator.engine_args, "generator.engine_args")  # before the evaluation's engine finds it
    check_eval_generator(cfg.generator)
    if cfg.trainer.keep_routing:
        raise ConfigError(
            "trainer.keep_routing=true: Keep Routing replays the experts an engine routed sampled "
            "tokens to, and SFT trains on the dataset's text, which no engine routed; remove it"
        )
    if cfg.trainer.profile_steps and max(cfg.trainer.profile_steps) > cfg.steps:  # a window would never end
        raise ConfigError(
            f"trainer.profile_steps={list(cfg.trainer.profile_steps)} goes past the run's last step "
            f"(steps={cfg.steps}); profile steps 1 to {cfg.steps}"
        )
    names = [r.name for r in cfg.rewards]
    if cfg.eval_size and cfg.task.eval_reward is not None and cfg.task.eval_reward not in names:
        raise ConfigError(f"task.eval_reward={cfg.task.eval_reward!r} is not one of the rewards {names}")


def _sft_postfix(run, line: dict) -> dict:
    return dict(loss=f"{line['train/loss']:.4f}")


def _no_line(step: int, line: dict) -> None:
    return None  # the progress bar's loss says it; metrics.jsonl has every step


SFT = Algorithm("SFT", step=sft_step, console_line=_no_line, postfix=_sft_postfix)


class SFTRun(RecipeRun):
    """One SFT run: the trainer, the evaluation's generator and reward actor (started on first use), what happens
    between steps; each step is `sft_step` (forge_rl/recipes/sft_step.py)."""

    def __init__(self, cfg: SFTConfig):
        super().__init__(cfg)
        self.algorithm = SFT
        self.start_step = 0
        self.roles: SFTRoles | None = None  # from start() on
        self.step_state: SFTState | None = None  # from start() on
        self.checkpoint_dir = Path(cfg.trainer.checkpoint_dir)
        self.summary: dict[str, Any] = dict(model=cfg.model, dataset=cfg.dataset)
        self.trainer = self.generator = self.reward = None
        self.exported: str | None = None  # the export the evaluation generator was started from
        self.saved_at: int | None = None
        self.train_s = 0.0

    def prepare(self) -> None:
        """Checks, the model's path, the data and the held-out set, the output directory: no actor yet."""
        cfg = self.cfg
        check_config(cfg)
        self.dp = dp_size(cfg)
        self.model_dir = model_path(cfg.model)
        self.trainer_cfg = replace(
            cfg.trainer, model=self.model_dir, objective="sft", profile_dir=str(self.out / "profile")
        )  # trainer.profile_steps' traces
        self.tokenizer = load_tokenizer(self.model_dir)
        max_len = json.loads((Path(self.model_dir) / "config.json").read_text()).get("max_position_embeddings")
        self.source = make_source(cfg.dataset, self.tokenizer, cfg.seed, max_len, task=cfg.task)
        self.held_out = self._held_out(max_len) if cfg.eval_size else []
        self.claim_output(Path(cfg.trainer.checkpoint_dir), "sft")
        self.t_start = time.perf_counter()

    def _held_out(self, max_len: int | None) -> list:
        """The task's first eval_size held-out examples, rendered with the model's chat template; checked to fit
        the evaluation engine's max_model_len beside eval_max_tokens."""
        cfg = self.cfg
        try:
            rows = TaskRows(cfg.task, cfg.seed)
        except UserError:
            raise
        except ValueError as e:
            raise ConfigError(str(e)) from None
        examples = [e for _, e in zip(range(cfg.eval_size), rows.held_out())]
        if not examples:
            raise ConfigError(
                f"task.source={cfg.task.source!r} has no held-out set (task.held_out, "
                "task.held_out_fraction); set eval_size=0 for none"
            )
        model_len, max_tokens = (
            int(cfg.generator.engine_args.get("max_model_len") or max_len or 0),
            eval_max_tokens(cfg),
        )
        if model_len:
            check_prompts_fit(
                f"task.held_out {rows.cfg.held_out!r}",
                examples,
                self.tokenizer,
                rows.cfg,
                model_len - max_tokens,
                f"generator.engine_args.max_model_len {model_len} minus "
                f"generator.sampling.max_tokens={max_tokens}: raise generator.engine_args.max_model_len or "
                "shorten the prompts",
            )
        return [replace(e, text=render(self.tokenizer, e, rows.cfg)) for e in examples]

    async def start_roles(self, hosts: dict) -> None:
        """The trainer (resumed when asked to); the evaluation's generator starts with the first evaluation."""
        cfg = self.cfg
        # On a GPU host every trainer proc gets its own GPU, and the evaluation generator one more.
        self.use_gpus = bool(cfg.launcher.slurm.gpus_per_node) if hosts else bool(visible_gpus())
        self.weight_source = await weight_server(None) if hosts else None  # the default store, as the trainer's
        if self.log_dir:
            self.console.print(f"the procs' logs (TorchTitan, vLLM, Monarch) go to {self.log_dir}/ (--verbose: here)")
        self.console.print(f"starting the trainer ({cfg.trainer_procs} proc(s), dp={self.dp}) on {self.model_dir} ...")
        self.trainer = await Trainer.options(
            procs=cfg.trainer_procs, spmd=True, gpus=self.use_gpus, host_mesh="trainer"
        ).as_actor(self.trainer_cfg)
        path = self.claim.resume_from  # chosen and verified by claim_output_dir
        if path is not None:
            self.start_step = self.saved_at = (await self.trainer.load.call(str(path))).get(0)
            self.console.print(f"resumed run {self.claim.run_id} from {path}")
        self.summary.update(run_id=self.claim.run_id, start_step=self.start_step)
        self.log = MetricsLogger(self.out, resume_step=self.start_step if path is not None else None)
        self.t_train = time.perf_counter()
        self.roles = SFTRoles(await Ranks.of(self.trainer))
        pad_id = self.tokenizer.pad_token_id
        self.step_state = SFTState(
            self.source, cfg.batch_size, self.dp, pad_id, self.timeline, self.log, self.t_train, self.start_step
        )

    @property
    def step(self) -> int:
        """Optimizer steps taken (a resumed run starts at its checkpoint's)."""
        return self.step_state.step if self.step_state else self.start_step

    @property
    def losses(self) -> list[float]:
        return self.step_state.losses if self.step_state else []

    async def before_steps(self) -> None:
        """Nothing before the first step: the evaluation's engine starts with the first evaluation (~30 s on CPU)."""

    async def evaluate(self, final: bool = False) -> dict[str, Any]:
        """Greedy held-out accuracy of the current weights. The first evaluation starts a generator on an HF
        export of them (export_dir when it is the final one); later ones push the weights into it (the GRPO
        weight-sync path). No held-out set: nothing to do (an empty record)."""
        from forge_rl.actors.generator import Generator

        cfg, t0 = self.cfg, time.perf_counter()
        if not self.held_out:
            return {}
        if self.generator is None:
            eval_dir = cfg.export_dir if final and cfg.export_dir else str(self.out / "eval_model")
            await self.trainer.export_hf.call(eval_dir)
            self.exported = eval_dir if final else None
            self.generator, self.reward = await asyncio.gather(
                Generator.options(replicas=1, gpus=self.use_gpus, host_mesh="generator").as_service(
                    eval_dir,
                    engine_args=cfg.generator.engine_args,
                    seed=cfg.seed,
                    weight_source=self.weight_source,
                    engine_args_key="generator.engine_args",
                ),
                RewardActor.as_actor(cfg.rewards),
            )
        else:
            await self.trainer.push_weights.call(self.step)
            await self.generator.update_weights.call_all(self.step)
        eval_reward = cfg.task.eval_reward or cfg.rewards[0].name
        with self.timeline.span("evaluation", "evaluate", step=self.step):
            result = await evaluate_task(
                self.generator, self.reward, self.held_out, eval_reward, max_tokens=eval_max_tokens(cfg)
            )
        record = dict(**result, eval_s=time.perf_counter() - t0)
        self.log.log(self.step, {f"eval/{k}": v for k, v in record.items()})
        if not final:
            tqdm.write(f"step {self.step}: held-out greedy accuracy {record['accuracy']:.3f} (n={record['n']})")
        return record

    async def checkpoint(self) -> str:
        """The trainer's DCP checkpoint as trainer.checkpoint_dir/step-N, whole or not at all, with its manifest."""
        step = self.step

        async def write(partial: Path) -> None:
            with self.timeline.span("trainer", "checkpoint", step=step):
                await self.trainer.save.call(step, str(partial))

        path = await commit_checkpoint(Path(self.trainer_cfg.checkpoint_dir), step, self.claim.run_id, write)
        self.saved_at = step
        return str(path)

    async def finish(self, interrupted: bool = False) -> dict[str, Any]:
        """A checkpoint of the last step; unless interrupted, the final evaluation and the HF export. Writes
        summary.json and loss.png."""
        cfg = self.cfg
        self.train_s = time.perf_counter() - self.t_train
        if interrupted:  # the step in flight has finished (sft_step is interrupt-safe)
            self.console.print(f"[yellow]interrupted at step {self.step}: saving a checkpoint[/yellow]")
        checkpoint = (
            await self.checkpoint()
            if self.saved_at != self.step
            else f"{self.trainer_cfg.checkpoint_dir}/step-{self.step}"
        )
        if not interrupted:
            if self.held_out:
                r = await self.evaluate(final=True)
                self.summary.update(
                    eval_accuracy=r["accuracy"], eval_n=r["n"], eval_finished=r["finished"], eval_s=r["eval_s"]
                )
            if cfg.export_dir and self.exported != cfg.export_dir:
                await self.trainer.export_hf.call(cfg.export_dir)
        return self._write_summary(checkpoint, interrupted)

    async def save_on_interrupt(self) -> dict[str, Any]:
        """SIGTERM, Ctrl-C: a checkpoint of the last step and the summary (interrupted=true), no evaluation."""
        return await self.finish(interrupted=True)

    def _write_summary(self, checkpoint: str, interrupted: bool) -> dict[str, Any]:
        cfg, done = self.cfg, self.step - self.start_step
        self.summary.update(
            steps=self.step,
            trained_steps=done,
            interrupted=interrupted,
            first_loss=self.losses[0] if self.losses else math.nan,
            final_loss=self.losses[-1] if self.losses else math.nan,
            train_s=self.train_s,
            s_per_step=self.train_s / max(done, 1),
            wall_s=time.perf_counter() - self.t_start,
            checkpoint=checkpoint,
            export_dir=(cfg.export_dir or "") if not interrupted else "",
            busy_fraction={lane: round(f, 3) for lane, f in self.timeline.role_busy_fractions().items()},
        )
        self.log.close()
        self.timeline.write(self.out)
        plot_run(
            self.log.path, self.out / "loss.png", f"SFT {cfg.model} on {Path(cfg.dataset).name}", panels=SFT_PANELS
        )
        (self.out / "summary.json").write_text(json.dumps(self.summary, indent=2) + "\n")
        table = Table(title="forge_rl SFT")
        table.add_column("metric")
        table.add_column("value", justify="right")
        for k, v in self.summary.items():
            table.add_row(k, f"{v:.4g}" if isinstance(v, float) else str(v))
        self.console.print(table)
        self.console.print(
            f"wrote {self.out / 'summary.json'}, {self.out / 'metrics.jsonl'}, {self.out / 'loss.png'}, "
            f"{self.out / 'timeline.png'} and {self.out / 'timeline.json'} (Perfetto)"
        )
        return self.summary


CONFIG = SFTConfig
ALGORITHM = SFT


async def main(cfg: SFTConfig) -> dict[str, Any]:
    return await train(SFTRun(cfg))
