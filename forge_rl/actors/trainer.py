"""Trainer: the policy, TorchTitan's Qwen3 under FSDP2 and/or tensor parallelism, on a Monarch proc mesh of dp x tp
ranks.

    trainer = await Trainer.options(procs=2, spmd=True).as_actor(TrainerConfig(model="tiny", parallel=...))
    metrics = await trainer.step.call_one(batches, version)   # a list of dp_size TrainBatches; publishes `version`

Every rank runs the same endpoint (`.call()` on the mesh); each rank picks its data-parallel rank's batch, and the
ranks of one tensor-parallel group share it. The actor holds its parts as typed attributes (TorchTitan's style):

    model        TrainModel: the parallelised module, its facts and its logprob forward (train_model.py)
    optimizer    AdamW, with `scheduler` and the step `counts` (train_optimizer.py)
    weights      WeightsOut: publishing versions, the HF and PEFT exports (weights_out.py)
    checkpoint   TrainCheckpoint: DCP save and load (train_checkpoint.py)

The Critic and the Reference are actors of their own over the same parts. Its configuration (TrainerConfig and its
sections) is forge_rl/actors/trainer_config.py.
"""

import math
import time
from dataclasses import asdict
from pathlib import Path

import torch
from monarch.actor import endpoint

from forge_rl.actors.train_checkpoint import TrainCheckpoint
from forge_rl.actors.train_model import TrainModel
from forge_rl.actors.train_model_build import build_train_model
from forge_rl.actors.train_optimizer import StepCounts, build_optimizer
from forge_rl.actors.trainer_config import TrainerConfig
from forge_rl.actors.trainer_step import TOKEN_SUMS, accumulate_gradients
from forge_rl.actors.weights_out import WeightsOut
from forge_rl.observability.mfu import device_peak_flops, mfu
from forge_rl.observability.profiler import StepProfiler
from forge_rl.runtime import ForgeActor
from forge_rl.runtime.timeouts import hang_if_asked
from forge_rl.types import TrainBatch
from forge_rl.weights import WeightStoreConfig


def peak_rss_mb() -> float:
    """This process's peak RSS since exec (VmHWM; getrusage's maxrss can carry a forking parent's peak)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024  # kB
    return float("nan")


class Trainer(ForgeActor):
    model: TrainModel
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    weights: WeightsOut
    checkpoint: TrainCheckpoint
    profiler: StepProfiler

    def __init__(self, cfg: TrainerConfig | None = None, weight_store: WeightStoreConfig | None = None):
        self.cfg = cfg or TrainerConfig()
        if self.cfg.objective == "rl" and self.cfg.loss.normalize == "token_sum" and self.cfg.loss.max_response_len < 1:
            raise ValueError(
                "trainer.loss.normalize='token_sum' divides by a constant: set trainer.loss."
                "max_response_len (the GRPO run sets it to the generation budget)"
            )
        self.store_cfg = weight_store
        self.counts = StepCounts(self.cfg.max_nonfinite_steps)  # counts.taken: the policy version

    @endpoint
    async def setup(self) -> None:
        self.model = build_train_model(self.cfg)
        self.optimizer, self.scheduler = build_optimizer(self.model, self.cfg.optim)
        self.weights = WeightsOut(self.model, self.store_cfg)
        self.checkpoint = TrainCheckpoint(self.model, self.optimizer, self.scheduler, self.counts)
        device = self.model.device
        self.peak_flops, self.peak_source = device_peak_flops(device)  # each step's MFU is against it
        self.profiler = StepProfiler(
            self.cfg.profile_steps, self.cfg.profile_dir, self.model.rank, cuda=device.type == "cuda"
        )

    # ---- training ---------------------------------------------------------------------------------

    @endpoint
    async def step(self, batches: list[TrainBatch], version: int | None = None) -> dict[str, float]:
        """One training step on `batches` (one TrainBatch per dp rank): forward and backward over this rank's
        micro-batches, the gradients clipped, `optimizer.step()`, and with `version` the new weights published as
        that version into the weight store (the RL step; its timing and bytes are `metrics["publish"]`). A step
        whose gradient norm is not finite leaves the weights, optimizer state and schedule as they were; too many in
        a row stop the run. Returns the step's metrics, reduced over ranks."""
        self.model.validate_everywhere(batches)
        self.profiler.begin(self.counts.taken + 1)  # trainer.profile_steps; a no-op for other steps
        await hang_if_asked("step", self.model.rank, self.counts.taken + 1)  # a test's fault (runtime/timeouts.py)
        start = time.perf_counter()
        sums, mismatch_max = accumulate_gradients(self.model, batches)
        lr = self.scheduler.get_last_lr()[0]
        grad_norm = self.model.clip_grad_norm(self.cfg.optim.max_grad_norm)  # global: every rank takes one branch
        finite = math.isfinite(grad_norm)
        if finite:  # else the weights, optimizer state and schedule stay as they were
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.counts.count(finite, float(sums[0]))
        sums, mismatch_max = self.model.reduce_over_data_parallel(sums, mismatch_max)
        metrics = self._step_metrics(batches, sums, mismatch_max, lr, grad_norm, time.perf_counter() - start)
        if version is not None:  # the new weights into the weight store (forge_rl/actors/weights_out.py)
            metrics["publish"] = self.weights.publish(version)
            self.weights.release_step_memory()
        return metrics

    def _step_metrics(self, batches, sums, mismatch_max: float, lr: float, grad_norm: float, elapsed: float) -> dict:
        """The step's metrics from the sums reduced over ranks (TOKEN_SUMS, then Keep Routing's three counts)."""
        total_tokens = sum(b.num_response_tokens for b in batches)
        tokens = sum(b.num_tokens for b in batches)
        per_token = {name: float(sums[i]) / total_tokens for i, name in enumerate(TOKEN_SUMS, start=2)}
        replayed, differed, dispatched = (float(x) for x in sums[-3:])
        profiled = self.profiler.end(self.counts.taken)  # a profile window's last step: its trace and summary line
        seq_len = batches[self.model.dp_rank].tokens.shape[1]  # this rank's rows (the others: their shapes only)
        return dict(
            loss=float(sums[0]),
            grad_norm=grad_norm,
            lr=lr,
            step=self.counts.taken,
            **per_token,
            mismatch_abs_max=mismatch_max,
            tokens=tokens,
            model_tokens=int(sums[1]),  # what the model ran on: fewer than `tokens` when prompts were shared
            loss_parallel=float(self.model.loss_parallel),  # TP: logprobs from vocabulary shards, logits never gathered
            response_tokens=total_tokens,
            tokens_per_s=tokens / elapsed,
            step_s=elapsed,
            # model FLOPs utilisation of every rank's device (forge_rl/observability/mfu.py), rows at their length
            mfu=mfu(self.model.hf_config, tokens, seq_len, elapsed, self.peak_flops, self.model.world),
            peak_rss_mb=peak_rss_mb(),  # this rank's, not reduced
            **(
                {"peak_cuda_reserved_mb": torch.cuda.max_memory_reserved(self.model.device) / 2**20}
                if self.model.device.type == "cuda"
                else {}
            ),  # this rank's
            skipped=float(not math.isfinite(grad_norm)),
            skipped_steps=self.counts.skipped,
            # Keep Routing: (position, layer) pairs given the engine's experts; the fraction the trainer's own
            # routers would have sent elsewhere; the fraction whose experts, as the expert layers received them,
            # were the engine's
            **(
                {
                    "keep_routing/replayed": replayed,
                    "keep_routing/differed_fraction": differed / max(replayed, 1.0),
                    "keep_routing/dispatched_equal_fraction": dispatched / max(replayed, 1.0),
                }
                if self.model.route_replay is not None
                else {}
            ),
            **({"profile/summary": profiled} if profiled else {}),
        )

    @endpoint
    async def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Logprob [B, T] of every token of `batch` under the current weights (every rank, same batch)."""
        self.model.module.eval()
        with torch.no_grad():
            logprobs, _ = self.model.logprobs(
                batch.tokens, kept=batch.kept, routes=batch.routes, images=batch.images, sampled=batch.response_mask
            )
        return logprobs.cpu()

    @endpoint
    async def data_shard(self) -> int:
        """This rank's data-parallel shard: the index of the batch it trains on (ranks of one TP group share it)."""
        return self.model.dp_rank

    @endpoint
    async def version(self) -> int:
        """The policy version: optimizer steps taken so far."""
        return self.counts.taken

    # ---- weights out (forge_rl/actors/weights_out.py) ---------------------------------------------

    @endpoint
    async def push_weights(self, version: int) -> dict[str, float]:
        """Publish the current weights as `version` (HF names) in the weight store, every rank its own blocks; then
        a trainer sharing its GPU gives its cached blocks back."""
        result = self.weights.publish(version)
        self.weights.release_step_memory()
        return result

    @endpoint
    async def export_adapter(self, out_dir: str) -> str:
        """LoRA: write the adapters as a PEFT adapter directory (adapter_model.safetensors +
        adapter_config.json), which `peft.PeftModel.from_pretrained(base, out_dir)` and vLLM load."""
        return self.weights.export_adapter(out_dir)

    @endpoint
    async def export_hf(self, out_dir: str, dtype: str | None = None) -> str:
        """Write an HF model directory (sharded safetensors + config + tokenizer) that transformers and vLLM load,
        streamed to rank 0 a block at a time, in `dtype` (default: the publish dtype; "float32": the fp32 masters).
        With LoRA, the adapters are merged in."""
        return self.weights.export_hf(out_dir, dtype)

    # ---- checkpoints (forge_rl/actors/train_checkpoint.py) ----------------------------------------

    @endpoint
    async def save(self, step: int | None = None, path: str | None = None) -> str:
        """DCP checkpoint of model, optimizer, LR schedule and step into `path`; without one, checkpoint_dir/step-N
        committed whole with its manifest."""
        return await self.checkpoint.save(step, path)

    @endpoint
    async def load(self, path: str | None = None) -> int:
        """Restore from `path`, or without one from the newest intact checkpoint `save()` wrote. Returns the step."""
        return self.checkpoint.load(path)

    @endpoint
    async def config(self) -> dict:
        return asdict(self.cfg)

    @endpoint
    async def load_stats(self) -> dict[str, int]:
        """What this rank read of the checkpoint at start: bytes_read, largest_read, checkpoint_bytes."""
        return dict(self.model.checkpoint_read)

    async def __cleanup__(self, exc: Exception | None) -> None:
        if getattr(self, "weights", None) is not None:
            self.weights.close()
