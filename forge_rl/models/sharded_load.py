"""Load a Hugging Face safetensors checkpoint into a model whose parameters may be sharded (FSDP2, TP), each rank
reading only the part of each tensor its shard holds.

Reading whole files on every rank and sharding afterwards costs every rank the whole model (and again in fp32
when the masters are upcast): 32 ranks of a 32B model would hold ~130 GB each. Here safetensors' lazy
`safe_open(...).get_slice` reads, tensor by tensor, the rows or columns of this rank's shard (its offset in
the whole tensor comes from the DTensor's placements), converts just that slice to the parameter's dtype and
wraps it as the local shard. Peak host memory per rank: its shard of the model plus one tensor's slice.
`SafetensorsCheckpoint` counts the bytes it read, which tests/integration/test_trainer.py checks against that bound.
"""

from pathlib import Path

import torch

from forge_rl.deps.pytorch import local_shape_and_global_offset, state_dict_name
from forge_rl.models import fused_qkv
from forge_rl.weights.layout import dtype_of
from forge_rl.weights.shards import row_blocks


class SafetensorsCheckpoint:
    """The tensors of a model directory's *.safetensors files, opened lazily (nothing is read until asked)."""

    def __init__(self, model_dir: str | Path):
        from safetensors import safe_open

        self.model_dir = Path(model_dir)
        files = sorted(self.model_dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{model_dir}: no *.safetensors files")
        self._file_of = {}
        for f in files:
            handle = safe_open(str(f), framework="pt")
            self._file_of.update({name: handle for name in handle.keys()})
        self.bytes_read = 0
        self.largest_read = 0

    @property
    def names(self) -> set[str]:
        return set(self._file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._file_of[name].get_slice(name).get_shape())

    def itemsize(self, name: str | None) -> int:
        """Bytes per element of tensor `name` on disk (4 for a name it lacks: a fused or extra tensor)."""
        dtype = dtype_of(self._file_of[name].get_slice(name).get_dtype()) if name in self._file_of else None
        return dtype.itemsize if dtype is not None else 4

    def read(
        self, name: str, offset: tuple[int, ...] | None = None, shape: tuple[int, ...] | None = None
    ) -> torch.Tensor:
        """The whole tensor `name`, or the block of `shape` starting at `offset`."""
        view = self._file_of[name].get_slice(name)
        if offset is None:
            tensor = view[:]
        else:
            tensor = view[tuple(slice(o, o + s) for o, s in zip(offset, shape))]
        self.bytes_read += tensor.nbytes
        self.largest_read = max(self.largest_read, tensor.nbytes)
        return tensor


def checkpoint_names(adapter, checkpoint: SafetensorsCheckpoint, ignore: tuple[str, ...] = ()) -> dict[str, str]:
    """The model's state-dict name -> the checkpoint tensor holding it, through the model's own state-dict
    adapter (TorchTitan's), fed placeholders so that nothing is read. `ignore`: checkpoint tensors that are not
    the model's (a sequence classifier's score head, when a critic starts from a reward model)."""
    placeholders = {name: torch.empty(0) for name in checkpoint.names if name not in ignore and not _is_expert(name)}
    source = {id(t): name for name, t in placeholders.items()}
    return {model_name: source[id(t)] for model_name, t in adapter.from_hf(placeholders).items()}


def _is_expert(name: str) -> bool:
    """A Qwen3-MoE checkpoint's per-expert tensor: TorchTitan stacks a layer's experts into one parameter, which
    is read here expert by expert (forge_rl/models/qwen3_moe.py), not through the adapter's concatenation."""
    return ".mlp.experts." in name


def _expert_sources(model: torch.nn.Module, checkpoint: SafetensorsCheckpoint) -> dict[str, list[str]]:
    """Each grouped expert parameter (state-dict name) -> the checkpoint's per-expert tensors it stacks."""
    from forge_rl.models import qwen3_moe  # TorchTitan's MoE: imported when a model loads, not with this module

    out = {}
    for module_path, param in model.named_parameters():
        name = state_dict_name(module_path)
        if qwen3_moe.expert_param(name) is not None:
            out[name] = qwen3_moe.expert_names(name, param.shape[0])
    return out


def load_sharded(
    model: torch.nn.Module,
    adapter,
    model_dir: str | Path,
    extra: dict[str, torch.Tensor] | None = None,
    ignore: tuple[str, ...] = (),
    block_bytes: int = 64 << 20,
    kept: tuple[str, ...] = (),
) -> dict[str, int]:
    """Load `model_dir`'s checkpoint into `model`'s parameters, each parameter's local shard read alone and
    copied into place; `extra` holds full tensors for parameters the checkpoint does not have (LoRA adapters
    at start); `ignore` names checkpoint tensors left unread; `kept`: names (and what is under them) whose
    parameters keep their values where the checkpoint lacks them (trainer.freeze's: a pushed version leaves them
    out). Returns the bytes read, the largest single read and the checkpoint's bytes. Each shard is read
    `block_bytes` of rows at a time, so no read exceeds it.

    Parameters are written directly, not through `load_state_dict`: TorchTitan's fused q/k/v projection
    would gather whole q, k and v tensors on every rank in its state-dict hooks, so its rows are read here
    from the checkpoint's q_proj, k_proj and v_proj instead (forge_rl/models/fused_qkv.py)."""
    checkpoint = SafetensorsCheckpoint(model_dir)
    names = checkpoint_names(adapter, checkpoint, ignore)
    if "tok_embeddings.weight" in names and "lm_head.weight" not in names:
        names["lm_head.weight"] = names["tok_embeddings.weight"]  # tied: HF checkpoints may omit the head
    experts = _expert_sources(model, checkpoint)
    extra = extra or {}
    kept_absent = {n for n in (state_dict_name(p) for p, _ in model.named_parameters()) if _under(n, kept)} - set(names)
    _check_names(model, names, {**extra, **dict.fromkeys(kept_absent)}, model_dir, experts, checkpoint)
    with torch.no_grad():
        for module_path, param in model.named_parameters():  # a tied weight once
            name = state_dict_name(module_path)  # the checkpoint's names are the state dict's
            if name in kept_absent:
                continue
            shape, offset = _local_block(param)
            _check_shape(checkpoint, names, experts, extra, name, tuple(param.shape), model_dir)
            local = _local(param)
            source = experts[name][0] if name in experts else names.get(name)
            # a block of rows at a time: what is read beyond the shard stays at most block_bytes
            for r0, r1 in row_blocks(shape, checkpoint.itemsize(source), block_bytes):
                at, rows = (offset[0] + r0, *offset[1:]), (r1 - r0, *shape[1:])
                if name in extra:
                    block = extra[name][tuple(slice(o, o + n) for o, n in zip(at, rows))]
                elif name in experts:  # rows are experts: each read from its own tensor, this rank's block of it
                    block = torch.stack(
                        [checkpoint.read(experts[name][e], at[1:], rows[1:]) for e in range(at[0], at[0] + rows[0])]
                    )
                elif name.endswith(fused_qkv.SUFFIX):
                    block = _read_fused_qkv(
                        checkpoint,
                        names,
                        model.get_submodule(module_path[: -len(fused_qkv.SUFFIX) - 1]),
                        name[: -len(fused_qkv.SUFFIX)],
                        rows,
                        at,
                    )
                else:
                    block = checkpoint.read(names[name], at, rows)
                local[r0:r1].copy_(block)
    return dict(
        bytes_read=checkpoint.bytes_read,
        largest_read=checkpoint.largest_read,
        checkpoint_bytes=sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors")),
    )


def _check_shape(checkpoint, names, experts, extra, name: str, shape: tuple[int, ...], model_dir) -> None:
    if name in extra or name.endswith(fused_qkv.SUFFIX):
        return
    if name in experts:
        have = (len(experts[name]), *checkpoint.shape(experts[name][0]))
        source = f"{experts[name][0]} and the layer's other experts"
    else:
        have, source = checkpoint.shape(names[name]), names[name]
    if have != shape:
        raise ValueError(f"{model_dir}: {source} has shape {have}, the model expects {shape}")


def _local(param: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return param.to_local() if isinstance(param, DTensor) else param


def _local_block(param: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(shape, offset) of this rank's block of `param` in the whole tensor."""
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor):
        return local_shape_and_global_offset(param)
    return tuple(param.shape), (0,) * param.dim()


def _read_fused_qkv(
    checkpoint: SafetensorsCheckpoint,
    names: dict[str, str],
    module,
    prefix: str,
    shape: tuple[int, ...],
    offset: tuple[int, ...],
) -> torch.Tensor:
    columns = (offset[1], shape[1])
    pieces = [
        checkpoint.read(names[prefix + source + ".weight"], (first, columns[0]), (end - first, columns[1]))
        for source, first, end in fused_qkv.rows(offset[0], offset[0] + shape[0], module.heads_per_kv, module.head_dim)
    ]
    return torch.cat(pieces) if pieces else torch.empty(shape)


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _check_names(
    model: torch.nn.Module,
    names: dict[str, str],
    extra: dict,
    model_dir,
    experts: dict[str, list[str]],
    checkpoint: SafetensorsCheckpoint,
) -> None:
    """Every parameter has its tensor(s) in the checkpoint (or in `extra`), and every checkpoint tensor a
    parameter (the state-dict names: a fused q/k/v parameter stands for wq, wk and wv; a grouped expert
    parameter for its experts' tensors)."""
    stacked = {source for sources in experts.values() for source in sources}
    if missing := sorted(stacked - checkpoint.names):
        raise ValueError(f"{model_dir}: checkpoint lacks {missing[:5]}")
    if unexpected := sorted(n for n in checkpoint.names if _is_expert(n) and n not in stacked):
        raise ValueError(f"{model_dir}: checkpoint has tensors the model does not: {unexpected[:5]}")
    names = {**names, **{name: sources[0] for name, sources in experts.items()}}
    wanted = set()
    for module_path, _ in model.named_parameters(remove_duplicate=False):
        name = state_dict_name(module_path)
        if name.endswith(fused_qkv.SUFFIX):
            wanted |= {name[: -len(fused_qkv.SUFFIX)] + w + ".weight" for w in fused_qkv.PARTS}
        else:
            wanted.add(name)
    if missing := sorted(k for k in wanted if k not in names and k not in extra):
        raise ValueError(f"{model_dir}: checkpoint lacks {missing[:5]}")
    if unexpected := sorted(set(names) - wanted):
        raise ValueError(f"{model_dir}: checkpoint has tensors the model does not: {unexpected[:5]}")
