"""Building a TrainModel on this actor's ranks: the process group, TorchTitan's device mesh for trainer.parallel, the
model on the meta device from the HF config, parallelised with TorchTitan's `parallelize_qwen3`, materialised, and
loaded from HF safetensors through TorchTitan's state-dict adapter, each rank reading only its shards.

    model = build_train_model(cfg)                                        # the policy: the checkpoint's model
    model = build_train_model(cfg, value_head_config, value_head_start, not_loaded=("score.weight",))  # the critic

A role that changes the model (the critic's value head) passes its own `model_config` and `initial_tensors` builders
(TorchTitan's TrainSpec style) instead of subclassing. TorchTitan's own Trainer is not used: an RL step is not its
data-loader loop (docs/stack.md).

CPU specifics (gloo): FSDP's PREMUL_SUM reduction does not exist on gloo, so FSDP modules are set to plain sum
reductions; TorchTitan's "partial_dtensor" SPMD backend is the one that works with FSDP here.
"""

import datetime
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable

import torch

from forge_rl.actors.train_model import TrainModel
from forge_rl.actors.trainer_config import TrainerConfig
from forge_rl.losses.fused_head import default_memory_bytes
from forge_rl.models import lora
from forge_rl.models.lora import is_adapter_key
from forge_rl.models.moe_aux import RouterStats
from forge_rl.models.route_replay import RouteReplay
from forge_rl.models.sharded_load import load_sharded
from forge_rl.deps.pytorch import state_dict_name

# (cfg, model_dir, TorchTitan's ParallelismConfig) -> the TorchTitan model config, with its TP sharding plans
ModelConfig = Callable[[TrainerConfig, Path, object], object]
# (cfg, model_dir, the built module) -> whole initial tensors of the parameters the checkpoint lacks
InitialTensors = Callable[[TrainerConfig, Path, torch.nn.Module], dict[str, torch.Tensor]]


def process_group_backend(device_type: str) -> str:
    """The trainer's torch.distributed backend: gloo on CPU; on CUDA, NCCL for CUDA tensors and gloo for CPU
    ones. An NCCL-only group fails on any collective over a CPU tensor (metric sums, a checkpoint's
    objects), so the group carries a CPU backend too."""
    return "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"


def checkpoint_config(cfg: TrainerConfig, model_dir: Path, parallelism) -> object:
    """The TorchTitan config of the checkpoint's model, with its TP sharding plans."""
    from forge_rl.models import qwen3, vision_language

    if vision_language.is_vision_language(qwen3.read_hf_config(model_dir)):
        config = vision_language.titan_config(model_dir)  # its language model; the tower is attached when built
    else:
        config = qwen3.titan_config(model_dir)
    config.update_from_config(config=_WithParallelism(parallelism))
    return config


def lora_adapters(cfg: TrainerConfig, model_dir: Path, module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """LoRA's adapters at their start (B = 0: training starts at the base); nothing without LoRA."""
    if not cfg.lora.enabled:
        return {}
    shapes = {k: tuple(v.shape) for k, v in module.named_parameters() if is_adapter_key(k)}
    return lora.initial_adapters(shapes, cfg.seed)


def build_train_model(
    cfg: TrainerConfig,
    model_config: ModelConfig = checkpoint_config,
    initial_tensors: InitialTensors = lora_adapters,
    not_loaded: tuple[str, ...] = (),
) -> TrainModel:
    """The process group (the spmd mesh option sets RANK, WORLD_SIZE and MASTER_*), then the model of `cfg.model` on
    this rank, built, parallelised and loaded. `not_loaded`: checkpoint tensors that are not this model's."""
    import torch.distributed as dist

    # through forge_rl/deps/torchtitan.py, which readies torch and the device type before TorchTitan's first import
    from forge_rl.models import qwen3, resolve_model_path, vision_language

    model_dir = Path(resolve_model_path(cfg.model))
    hf = qwen3.read_hf_config(model_dir)
    vision = vision_language.is_vision_language(hf)
    if vision and (why := cfg.vision_refusal()):
        raise ValueError(why)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(
            process_group_backend(device.type), timeout=datetime.timedelta(seconds=cfg.collective_timeout_s)
        )
    torch.manual_seed(cfg.seed)
    parallelism, dims = _parallel_dims(cfg, dist.get_world_size())
    config = model_config(cfg, model_dir, parallelism)
    if cfg.lora.enabled:  # after the TP plans: the adapters take their sharding from the base linears
        config = lora.convert(config, cfg.lora)
    module = _parallelised(cfg, config, parallelism, dims, device, hf if vision else None)
    from torchtitan.models.qwen3 import Qwen3StateDictAdapter

    adapter = Qwen3StateDictAdapter(config, str(model_dir))
    if vision:
        adapter = vision_language.VisionLanguageAdapter(adapter)
    # each rank reads only its shards of the checkpoint (forge_rl/models/sharded_load.py)
    read = load_sharded(module, adapter, model_dir, extra=initial_tensors(cfg, model_dir, module), ignore=not_loaded)
    freeze(module, cfg.freeze)
    # Under FSDP2 the lm_head's weight is whole on every rank between the decoder's forward and the end of its
    # backward (TorchTitan groups it with the final norm, which does not reshard after forward), and its gradient is
    # reduce-scattered with that group's: the fused logprobs use it then.
    fused_lm_head = cfg.fused_lm_head and dims.tp == 1 and not cfg.parallel.compile
    module._skip_lm_head = fused_lm_head  # the decoder returns hidden states; the head is in the logprobs
    batch_mesh = dims.get_optional_mesh("batch")
    return TrainModel(
        cfg=cfg,
        module=module,
        adapter=adapter,
        parallel_dims=dims,
        device=device,
        model_dir=model_dir,
        hf_config=vision_language.text_config(hf) if vision else hf,
        max_seq_len=config.layers[0].attention.rope.max_seq_len,
        vocab_size=config.vocab_size,
        autocast=cfg.dtype != "float32" and dims.dp_shard == 1,
        fused_lm_head=fused_lm_head,
        head_memory_bytes=int(cfg.lm_head_memory_mb * 2**20) if cfg.lm_head_memory_mb else default_memory_bytes(device),
        rank=dist.get_rank(),
        world=dist.get_world_size(),
        dp_rank=batch_mesh.get_local_rank() if batch_mesh is not None else 0,
        dp_size=batch_mesh.size() if batch_mesh is not None else 1,
        checkpoint_read=read,
        router_stats=RouterStats(module) if cfg.moe_aux_loss_coef else None,
        route_replay=RouteReplay(module) if cfg.keep_routing else None,
        image_processor=_image_processor(model_dir) if vision else None,
    )


def freeze(module: torch.nn.Module, names: list[str]) -> None:
    """trainer.freeze: the parameters under each of `names` (the module's own names) stop taking gradients, so
    the optimizer (built after) leaves them out and the push skips them. A name that matches nothing is an error
    naming the module's top-level parts."""
    params = {state_dict_name(n): p for n, p in module.named_parameters()}
    if why := unmatched_freeze(list(params), names):
        raise ValueError(why)
    for name in names:
        for param in (p for n, p in params.items() if _under(n, name)):
            param.requires_grad_(False)


def unmatched_freeze(parameter_names: list[str], names: list[str]) -> str | None:
    """One line naming the first of trainer.freeze's `names` that matches none of `parameter_names` (the module's),
    with the module's top-level parts to choose from; None when each matches."""
    for name in names:
        if not any(_under(n, name) for n in parameter_names):
            parts = sorted({n.split(".")[0] for n in parameter_names})
            return f"trainer.freeze: {name!r} names no parameter of the model; its parts are {parts}"
    return None


def parameter_names(model_dir: str | Path) -> list[str]:
    """The names of the parameters of the trainer's model of the checkpoint in `model_dir` (unsharded, no LoRA),
    built on the meta device: what trainer.freeze is checked against before any actor starts."""
    from forge_rl.models import qwen3, vision_language

    hf = qwen3.read_hf_config(model_dir)
    vision = vision_language.is_vision_language(hf)
    config = vision_language.titan_config(model_dir) if vision else qwen3.titan_config(model_dir)
    with torch.device("meta"):
        module = config.build()
        if vision:
            vision_language.attach_vision(module, hf)
    return [name for name, _ in module.named_parameters()]


def _under(parameter: str, name: str) -> bool:
    return parameter == name or parameter.startswith(name + ".")


def _image_processor(model_dir: Path):
    from forge_rl.data.vision import load_processor

    return load_processor(model_dir).image_processor


def _parallel_dims(cfg: TrainerConfig, world: int):
    """TorchTitan's parallelism config and device mesh for trainer.parallel over this actor's procs."""
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils

    p = cfg.parallel
    parallelism = ParallelismConfig(
        data_parallel_shard_degree=p.dp_shard,
        tensor_parallel_degree=p.tp,
        expert_parallel_degree=p.ep,
        spmd_backend="partial_dtensor",
    )
    try:
        dims = ParallelDims.from_config(parallelism, world)
    except (AssertionError, ValueError) as e:
        raise ValueError(
            f"trainer.parallel (dp_shard={p.dp_shard}, tp={p.tp}, ep={p.ep}) does not fit {world} procs: {e}"
        ) from None
    dist_utils.set_spmd_backend("partial_dtensor")
    dims.build_mesh()
    return parallelism, dims


def _parallelised(
    cfg: TrainerConfig, config, parallelism, dims, device: torch.device, vision_hf: dict | None = None
) -> torch.nn.Module:
    """The model built on the meta device, parallelised (FSDP2, TP, EP, compile, activation checkpointing as
    trainer.parallel says) and materialised on `device` (one RoPE cache for all layers), not yet loaded.
    `vision_hf`: a vision-language model's HF config, whose vision tower joins the decoder's root FSDP group."""
    from torchtitan.config import CompileConfig, TrainingConfig
    from torchtitan.distributed.activation_checkpoint import FullAC
    from torchtitan.models.qwen3.parallelize import parallelize_qwen3

    from forge_rl.models import qwen3, vision_language

    p = cfg.parallel
    with torch.device("meta"):
        module = config.build()
        if vision_hf is not None:
            vision_language.attach_vision(module, vision_hf)
    if vision_hf is not None and dims.dp_shard > 1:
        dtype = getattr(torch, cfg.dtype)
        vision_language.shard_vision_layers(module.vision, dims.get_mesh("fsdp"), dtype)
    module = parallelize_qwen3(
        module,
        parallel_dims=dims,
        training=TrainingConfig(mixed_precision_param=cfg.dtype),
        parallelism=parallelism,
        compile_config=CompileConfig(enable=p.compile),
        ac_config=FullAC.Config() if p.activation_checkpointing else None,
        dump_folder=cfg.checkpoint_dir,
        skip_dp=dims.dp_shard == 1,
    )
    _sum_gradients_over_ranks(module, device)
    qwen3.materialise(module, device)
    lora.add_dropout(module, cfg.lora.dropout)
    return module


def _sum_gradients_over_ranks(module: torch.nn.Module, device: torch.device) -> None:
    from torch.distributed.fsdp import FSDPModule

    for part in module.modules():
        if isinstance(part, FSDPModule):
            # Each rank's loss is already its share of the whole batch's loss (global counts), so gradients must be
            # summed over ranks, not averaged.
            part.set_gradient_divide_factor(1.0)
            if device.type == "cpu":
                part.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM


@dataclass
class _WithParallelism:
    """What `Qwen3Model.Config.update_from_config` reads: an object with a `parallelism` field."""

    parallelism: object
