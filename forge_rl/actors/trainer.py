"""Trainer: TorchTitan's Qwen3 under FSDP2 and/or tensor parallelism, on a Monarch proc mesh of dp x tp ranks.

    trainer = await Trainer.options(procs=2, spmd=True).as_actor(TrainerConfig(model="tiny", parallel=...))
    metrics = await trainer.step.call_one(batches, version)   # a list of dp_size TrainBatches; publishes `version`

Every rank runs the same endpoint (`.call()` on the mesh); each rank picks its data-parallel rank's batch,
and the ranks of one tensor-parallel group share it. The model is built on the meta device from the HF
config, parallelised with TorchTitan's `parallelize_qwen3`, materialised, and loaded from HF safetensors
through TorchTitan's state-dict adapter. TorchTitan's own Trainer/ForgeEngine is not used: an RL step is not
its data-loader loop (docs/stack.md).

CPU specifics (gloo): FSDP's PREMUL_SUM reduction does not exist on gloo, so FSDP modules are set to
plain sum reductions; TorchTitan's "partial_dtensor" SPMD backend is the one that works with FSDP here.

Its configuration (TrainerConfig and its sections) is forge_rl/actors/trainer_config.py.
"""

import asyncio
import datetime
import math
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from monarch.actor import endpoint

from forge_rl.runtime import ForgeActor
from forge_rl.runtime.manifest import STANDALONE, commit, newest_intact, write_rank_digests
from forge_rl.runtime.timeouts import hang_if_asked
from forge_rl.models import lora
from forge_rl.models.lora import is_adapter_key
from forge_rl.models.moe_aux import RouterStats
from forge_rl.models.route_replay import RouteReplay
from forge_rl.models.sharded_load import load_sharded
from forge_rl.observability.mfu import device_peak_flops, mfu
from forge_rl.observability.profiler import StepProfiler
from forge_rl.losses.fused_head import default_memory_bytes
from forge_rl.types import TrainBatch
from forge_rl.actors.trainer_config import OptimizerConfig, TrainerConfig
from forge_rl.actors.trainer_step import TOKEN_SUMS, TrainerStep
from forge_rl.actors.trainer_weights import TrainerWeights
from forge_rl.weights import ShmWeightStore, WeightStoreConfig


def process_group_backend(device_type: str) -> str:
    """The trainer's torch.distributed backend: gloo on CPU; on CUDA, NCCL for CUDA tensors and gloo for CPU
    ones. An NCCL-only group fails on any collective over a CPU tensor (metric sums, a checkpoint's
    objects), so the group carries a CPU backend too."""
    return "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"


def lr_lambda(cfg: OptimizerConfig):
    """Linear warm-up, then cosine decay to min_lr_ratio (or constant when decay_steps is 0)."""

    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / (cfg.warmup_steps + 1)
        if not cfg.decay_steps:
            return 1.0
        progress = min(1.0, (step - cfg.warmup_steps) / cfg.decay_steps)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def _peak_rss_mb() -> float:
    """This process's peak RSS since exec (VmHWM; getrusage's maxrss can carry a forking parent's peak)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024  # kB
    return float("nan")


class Trainer(TrainerStep, TrainerWeights, ForgeActor):
    NOT_LOADED: tuple[str, ...] = ()  # checkpoint tensors that are not this model's

    def __init__(self, cfg: TrainerConfig | None = None, weight_store: WeightStoreConfig | None = None):
        self.cfg = cfg or TrainerConfig()
        if self.cfg.objective == "rl" and self.cfg.loss.normalize == "token_sum" and self.cfg.loss.max_response_len < 1:
            raise ValueError(
                "trainer.loss.normalize='token_sum' divides by a constant: set trainer.loss."
                "max_response_len (the GRPO run sets it to the generation budget)"
            )
        self.store_cfg = weight_store
        self.store: ShmWeightStore | None = None  # opened at the first push_weights
        self.steps_taken = 0  # optimizer steps, skipped ones included: the policy version
        self.skipped_steps = 0  # non-finite gradient norm: no update
        self.nonfinite_in_a_row = 0

    @endpoint
    async def setup(self) -> None:
        import torch.distributed as dist

        from forge_rl.models import resolve_model_path
        from forge_rl.models import qwen3
        from forge_rl.models.qwen3_config import attention_pair_cost

        self.model_dir = Path(resolve_model_path(self.cfg.model))
        self.device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        if not dist.is_initialized():  # env (RANK, WORLD_SIZE, MASTER_*) comes from the spmd mesh option
            dist.init_process_group(
                process_group_backend(self.device.type),
                timeout=datetime.timedelta(seconds=self.cfg.collective_timeout_s),
            )
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(self.cfg.seed)
        self.model, self.adapter, self.parallel_dims = self._build(qwen3)
        self.router_stats = RouterStats(self.model) if self.cfg.moe_aux_loss_coef else None
        self.route_replay = RouteReplay(self.model) if self.cfg.keep_routing else None
        hf_config = qwen3.read_hf_config(self.model_dir)
        self.tied = bool(hf_config.get("tie_word_embeddings", False))
        self.head_dim = hf_config.get("head_dim") or hf_config["hidden_size"] // hf_config["num_attention_heads"]
        self.heads_per_kv = hf_config["num_attention_heads"] // hf_config["num_key_value_heads"]
        self.attention_pair_cost = attention_pair_cost(hf_config)  # weighs shared-prompt packing
        self.hf_config = hf_config
        self.peak_flops, self.peak_source = device_peak_flops(self.device)  # each step's MFU is against it
        batch_mesh = self.parallel_dims.get_optional_mesh("batch")
        self.dp_size = batch_mesh.size() if batch_mesh is not None else 1
        self.dp_rank = batch_mesh.get_local_rank() if batch_mesh is not None else 0
        o = self.cfg.optim
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],  # with LoRA: the adapters only
            lr=o.lr,
            betas=(o.beta1, o.beta2),
            eps=o.eps,
            weight_decay=o.weight_decay,
            # one kernel over every tensor (faster than foreach, which launches per tensor group); experts' parameters
            # live on another mesh than the rest, which the fused kernel does not take in one call
            **(dict(foreach=True) if self.parallel_dims.ep_enabled else dict(fused=True)),
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(o))
        self.profiler = StepProfiler(
            self.cfg.profile_steps, self.cfg.profile_dir, self.rank, cuda=self.device.type == "cuda"
        )

    def _parallel_dims(self):
        """TorchTitan's parallelism config and device mesh for trainer.parallel over this actor's procs."""
        from torchtitan.config import ParallelismConfig
        from torchtitan.distributed import ParallelDims
        from torchtitan.distributed import utils as dist_utils

        p = self.cfg.parallel
        parallelism = ParallelismConfig(
            data_parallel_shard_degree=p.dp_shard,
            tensor_parallel_degree=p.tp,
            expert_parallel_degree=p.ep,
            spmd_backend="partial_dtensor",
        )
        try:
            dims = ParallelDims.from_config(parallelism, self.world)
        except (AssertionError, ValueError) as e:
            raise ValueError(
                f"trainer.parallel (dp_shard={p.dp_shard}, tp={p.tp}, ep={p.ep}) does not fit {self.world} procs: {e}"
            ) from None
        dist_utils.set_spmd_backend("partial_dtensor")
        dims.build_mesh()
        return parallelism, dims

    def _sum_gradients_over_ranks(self, model) -> None:
        from torch.distributed.fsdp import FSDPModule

        for module in model.modules():
            if isinstance(module, FSDPModule):
                # Each rank's loss is already its share of the whole batch's loss (global counts), so
                # gradients must be summed over ranks, not averaged.
                module.set_gradient_divide_factor(1.0)
                if self.device.type == "cpu":
                    module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM

    def _build(self, qwen3):
        from torchtitan.config import CompileConfig, TrainingConfig
        from torchtitan.distributed.activation_checkpoint import FullAC
        from torchtitan.models.qwen3 import Qwen3StateDictAdapter
        from torchtitan.models.qwen3.parallelize import parallelize_qwen3

        p = self.cfg.parallel
        parallelism, dims = self._parallel_dims()
        config = self._model_config(qwen3, parallelism)
        if self.cfg.lora.enabled:  # after the TP plans: the adapters take their sharding from the base linears
            config = lora.convert(config, self.cfg.lora)
        with torch.device("meta"):
            model = config.build()
        model = parallelize_qwen3(
            model,
            parallel_dims=dims,
            training=TrainingConfig(mixed_precision_param=self.cfg.dtype),
            parallelism=parallelism,
            compile_config=CompileConfig(enable=p.compile),
            ac_config=FullAC.Config() if p.activation_checkpointing else None,
            dump_folder=self.cfg.checkpoint_dir,
            skip_dp=dims.dp_shard == 1,
        )
        self._sum_gradients_over_ranks(model)
        qwen3.materialise(model, self.device)  # one RoPE cache for all layers
        lora.add_dropout(model, self.cfg.lora.dropout)
        adapter = Qwen3StateDictAdapter(config, str(self.model_dir))
        # each rank reads only its shards of the checkpoint (forge_rl/models/sharded_load.py)
        self.checkpoint_read = load_sharded(
            model, adapter, self.model_dir, extra=self._not_in_checkpoint(model), ignore=self.NOT_LOADED
        )
        self.max_seq_len = config.layers[0].attention.rope.max_seq_len
        self.vocab_size = config.vocab_size
        # Without FSDP there is no mixed-precision policy: autocast gives the compute dtype instead.
        self.autocast = self.cfg.dtype != "float32" and dims.dp_shard == 1
        # Under FSDP2 the lm_head's weight is whole on every rank between the decoder's forward and the end
        # of its backward (TorchTitan groups it with the final norm, which does not reshard after forward),
        # and its gradient is reduce-scattered with that group's: the fused logprobs use it then.
        self.fused_lm_head = self.cfg.fused_lm_head and dims.tp == 1 and not p.compile
        self.loss_parallel = False  # set once the model hands back vocabulary-sharded logits (TP)
        model._skip_lm_head = self.fused_lm_head  # the decoder returns hidden states; the head is in the logprobs
        self.head_memory_bytes = (
            int(self.cfg.lm_head_memory_mb * 2**20) if self.cfg.lm_head_memory_mb else default_memory_bytes(self.device)
        )
        return model, adapter, dims

    def _model_config(self, qwen3, parallelism):
        """The TorchTitan config of the model this actor trains, with its TP sharding plans: the checkpoint's (the
        Critic's has a value head)."""
        config = qwen3.titan_config(self.model_dir)
        config.update_from_config(config=_WithParallelism(parallelism))
        return config

    def _not_in_checkpoint(self, model) -> dict[str, torch.Tensor]:
        """Whole initial tensors of the parameters the checkpoint lacks: LoRA's adapters."""
        if not self.cfg.lora.enabled:
            return {}
        shapes = {k: tuple(v.shape) for k, v in model.named_parameters() if is_adapter_key(k)}
        return lora.initial_adapters(shapes, self.cfg.seed)

    # ---- training (the step itself: forge_rl/actors/trainer_step.py) ------------------------------

    @endpoint
    async def step(self, batches: list[TrainBatch], version: int | None = None) -> dict[str, float]:
        """One training step on `batches` (one TrainBatch per dp rank): forward and backward over this rank's
        micro-batches, the gradients clipped, `optimizer.step()`, and with `version` the new weights published as
        that version into the weight store (the RL step; its timing and bytes are `metrics["publish"]`). A step
        whose gradient norm is not finite leaves the weights, optimizer state and schedule as they were; too many in
        a row stop the run. Returns the step's metrics, reduced over ranks."""
        self._validate_everywhere(batches)
        self.profiler.begin(self.steps_taken + 1)  # trainer.profile_steps; a no-op for other steps
        await hang_if_asked("step", self.rank, self.steps_taken + 1)  # a test's fault (runtime/timeouts.py); no-op
        start = time.perf_counter()
        sums, mismatch_max = self._accumulate_gradients(batches)
        lr = self.scheduler.get_last_lr()[0]
        grad_norm = self._clip_grad_norm()  # global over ranks, so every rank takes the same branch
        finite = math.isfinite(grad_norm)
        if finite:  # else the weights, optimizer state and schedule stay as they were
            self.optimizer.step()
            self.scheduler.step()
        self._count_step(finite, float(sums[0]))
        sums, mismatch_max = self._reduce_over_data_parallel(sums, mismatch_max)
        metrics = self._step_metrics(batches, sums, mismatch_max, lr, grad_norm, time.perf_counter() - start)
        if version is not None:  # the new weights into the weight store (forge_rl/actors/trainer_weights.py)
            metrics["publish"] = self._publish(version)
            self._release_step_memory()
        return metrics

    def _step_metrics(self, batches, sums, mismatch_max: float, lr: float, grad_norm: float, elapsed: float) -> dict:
        """The step's metrics from the sums reduced over ranks (TOKEN_SUMS, then Keep Routing's three counts)."""
        total_tokens = sum(b.num_response_tokens for b in batches)
        tokens = sum(b.num_tokens for b in batches)
        per_token = {name: float(sums[i]) / total_tokens for i, name in enumerate(TOKEN_SUMS, start=2)}
        replayed, differed, dispatched = (float(x) for x in sums[-3:])
        profiled = self.profiler.end(self.steps_taken)  # a profile window's last step: its trace and summary line
        seq_len = batches[self.dp_rank].tokens.shape[1]  # this rank's rows (the others: their shapes only)
        return dict(
            loss=float(sums[0]),
            grad_norm=grad_norm,
            lr=lr,
            step=self.steps_taken,
            **per_token,
            mismatch_abs_max=mismatch_max,
            tokens=tokens,
            model_tokens=int(sums[1]),  # what the model ran on: fewer than `tokens` when prompts were shared
            loss_parallel=float(self.loss_parallel),  # TP: logprobs from vocabulary shards, logits never gathered
            response_tokens=total_tokens,
            tokens_per_s=tokens / elapsed,
            step_s=elapsed,
            # model FLOPs utilisation of every rank's device (forge_rl/observability/mfu.py), rows at their length
            mfu=mfu(self.hf_config, tokens, seq_len, elapsed, self.peak_flops, self.world),
            peak_rss_mb=_peak_rss_mb(),  # this rank's, not reduced
            **(
                {"peak_cuda_reserved_mb": torch.cuda.max_memory_reserved(self.device) / 2**20}
                if self.device.type == "cuda"
                else {}
            ),  # this rank's
            skipped=float(not math.isfinite(grad_norm)),
            skipped_steps=self.skipped_steps,
            # Keep Routing: (position, layer) pairs given the engine's experts; the fraction the trainer's own
            # routers would have sent elsewhere; the fraction whose experts, as the expert layers received them,
            # were the engine's
            **(
                {
                    "keep_routing/replayed": replayed,
                    "keep_routing/differed_fraction": differed / max(replayed, 1.0),
                    "keep_routing/dispatched_equal_fraction": dispatched / max(replayed, 1.0),
                }
                if self.route_replay is not None
                else {}
            ),
            **({"profile/summary": profiled} if profiled else {}),
        )

    @endpoint
    async def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Logprob [B, T] of every token of `batch` under the current weights (every rank, same batch)."""
        self.model.eval()
        with torch.no_grad():
            logprobs, _ = self._forward(batch.tokens, kept=batch.kept, routes=batch.routes)
        return logprobs.cpu()

    @endpoint
    async def data_shard(self) -> int:
        """This rank's data-parallel shard: the index of the batch it trains on (ranks of one TP group share it)."""
        return self.dp_rank

    @endpoint
    async def version(self) -> int:
        """The policy version: optimizer steps taken so far."""
        return self.steps_taken

    # ---- weights out (forge_rl/actors/trainer_weights.py) ----------------------------------------

    @endpoint
    async def push_weights(self, version: int) -> dict[str, float]:
        """Publish the current weights as `version` (HF names) in the weight store.

        Every rank writes its own blocks of each parameter straight into the version's shared-memory file at their
        global offsets (ranks on several hosts: streams them to rank 0), so no rank gathers a tensor; the last rank
        to finish makes the version visible. Then a trainer sharing its GPU gives its cached blocks back."""
        result = self._publish(version)
        self._release_step_memory()
        return result

    def _release_step_memory(self) -> None:
        """A trainer sharing its GPU gives the step's cached blocks back before the engine wakes up: the caching
        allocator would otherwise keep the step's peak (trainer.release_memory_after_step)."""
        if self.cfg.release_memory_after_step and self.device.type == "cuda":
            torch.cuda.empty_cache()

    @endpoint
    async def export_adapter(self, out_dir: str) -> str:
        """LoRA: write the adapters as a PEFT adapter directory (adapter_model.safetensors +
        adapter_config.json), which `peft.PeftModel.from_pretrained(base, out_dir)` and vLLM load."""
        import json

        import torch.distributed as dist
        from safetensors.torch import save_file

        if not self.cfg.lora.enabled:
            raise ValueError("export_adapter: the trainer has no LoRA adapters (trainer.lora.rank is 0)")
        peft = {k: v.contiguous() for k, v in self._peft(self._adapter_tensors()).items()}
        out = Path(out_dir)
        if self.rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            save_file(peft, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
            config = self.cfg.lora.peft_config(self.model_dir.resolve())
            (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
        dist.barrier()
        return str(out)

    @endpoint
    async def export_hf(self, out_dir: str, dtype: str | None = None) -> str:
        """Write an HF model directory (sharded safetensors + config + tokenizer) that transformers and vLLM load,
        streamed to rank 0 a block at a time, in `dtype` (default: the publish dtype; "float32": the fp32 masters).
        With LoRA, the adapters are merged in."""
        return self._export_hf(out_dir, dtype)

    # ---- checkpoints ----------------------------------------------------------------------------

    def _state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return {
            "model": self._model_tensors(),
            "optim": get_optimizer_state_dict(self.model, self.optimizer),
            # the torch RNG: LoRA's dropout draws from it, so a resumed run drops what the uninterrupted one did
            "train": {"step": self.steps_taken, "scheduler": self.scheduler.state_dict(), "rng": torch.get_rng_state()},
        }

    @endpoint
    async def save(self, step: int | None = None, path: str | None = None) -> str:
        """DCP checkpoint of model, optimizer, LR schedule and step into `path`, each rank writing its own shards
        and hashing them in a thread (`.sha256-rank-N.json`, for the manifest the caller commits:
        forge_rl/loop/checkpoint.py). Without `path`: checkpoint_dir/step-N, committed here whole with its
        manifest (owner "trainer"), as a run's checkpoints are."""
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        step = self.steps_taken if step is None else step
        final = Path(self.cfg.checkpoint_dir) / f"step-{step}"
        target = Path(path) if path else final.parent / f".step-{step}.{STANDALONE}.partial"
        if path is None and self.rank == 0:
            shutil.rmtree(target, ignore_errors=True)  # an earlier failed save's
        dist.barrier()
        dcp.save(self._state(), checkpoint_id=str(target))
        await asyncio.to_thread(write_rank_digests, target, self.rank)
        dist.barrier()
        if path is None:
            if self.rank == 0:
                await asyncio.to_thread(commit, target, final, STANDALONE, step)
            dist.barrier()
        return str(path or final)

    @endpoint
    async def load(self, path: str | None = None) -> int:
        """Restore from `path` (a run's checkpoint: the run verified it), or without one from the newest intact
        checkpoint that `save()` without a path wrote under checkpoint_dir (rank 0 verifies). Returns the step."""
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        if path is None:
            found = [newest_intact(self.cfg.checkpoint_dir, STANDALONE) if self.rank == 0 else None]
            dist.broadcast_object_list(found, src=0)
            newest, skipped = found[0]
            if newest is None:
                why = f" (passed over {'; '.join(skipped)})" if skipped else ""
                raise FileNotFoundError(
                    f"no intact checkpoint of Trainer.save() under trainer.checkpoint_dir="
                    f"{self.cfg.checkpoint_dir}{why}: pass the path of one to load"
                )
            path = str(newest)
        if not (Path(path) / ".metadata").is_file():
            raise FileNotFoundError(f"{path}: not a DCP checkpoint (no .metadata)")
        state = self._state()
        if "train.rng" not in dcp.FileSystemReader(path).read_metadata().state_dict_metadata:
            del state["train"]["rng"]  # a checkpoint without the trainer's RNG state (an older format)
        dcp.load(state, checkpoint_id=path)  # into the parameters' own shards, in place
        set_optimizer_state_dict(self.model, self.optimizer, state["optim"])
        self.scheduler.load_state_dict(state["train"]["scheduler"])
        if "rng" in state["train"]:
            torch.set_rng_state(state["train"]["rng"])
        self.steps_taken = int(state["train"]["step"])
        return self.steps_taken

    @endpoint
    async def config(self) -> dict:
        return asdict(self.cfg)

    @endpoint
    async def load_stats(self) -> dict[str, int]:
        """What this rank read of the checkpoint at start: bytes_read, largest_read, checkpoint_bytes."""
        return dict(self.checkpoint_read)

    async def __cleanup__(self, exc: Exception | None) -> None:
        if self.store is not None:
            self.store.close()


@dataclass
class _WithParallelism:
    """What `Qwen3Model.Config.update_from_config` reads: an object with a `parallelism` field."""

    parallelism: object
