"""The trainer's weights going out: publishing versions to the generators, exporting an HF model directory, and the
tensors of a checkpoint. A mixin of Trainer (forge_rl/actors/trainer.py), which holds the model and its ranks.

Nothing here gathers a sharded parameter whole. Every path works from each rank's own block of each parameter
(forge_rl/weights/sharded_publish.py): on one host every rank writes its blocks into the version's shared memory;
across hosts, and for the export, every rank streams its blocks to rank 0 a block of rows at a time; a checkpoint
saves the parameters themselves (DCP writes each rank's shards). TorchTitan's `model.state_dict()` is not used: its
hook turns every layer's fused q/k/v into whole q, k and v tensors on every rank.
"""

import contextlib
import math
import os
import socket
import time

import torch

from forge_rl.deps.pytorch import state_dict_name
from forge_rl.models import fused_qkv, lora
from forge_rl.models.lora import is_adapter_key
from forge_rl.weights import ShmWeightStore, sharded_publish, spec_of
from forge_rl.weights.hf_export import HFExportWriter

HF_ASSETS = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)


class TrainerWeights:
    """Trainer's weights-out half: needs self.model, adapter, rank, world, cfg, store, store_cfg, device, tied,
    heads_per_kv, head_dim, model_dir."""

    _publish_plan: sharded_publish.Plan | None = None  # who writes which block: the boxes never change
    _ranks_share_host: bool | None = None
    publish_largest_held = 0

    # ---- publishing -----------------------------------------------------------------------------

    def _publish(self, version: int) -> dict[str, float]:
        start = time.perf_counter()
        if self.store is None:
            self.store = ShmWeightStore(cfg=self.store_cfg)
        dtype = self._publish_dtype()
        if self.cfg.lora.enabled:
            return self._push_adapter(version, dtype, start)
        if self.cfg.publish_from == "rank0" or not self._on_one_host():
            # Ranks on several hosts: a rank cannot write another host's shared memory. Rank 0 publishes on its
            # host (where the weight server hands versions to other hosts); the others send it their shards.
            nbytes = self._stream_to_rank0(
                lambda spec: self.store.writer(version, spec), dtype, f"weights version {version}"
            )
        else:
            targets, plan = self._hf_targets(), self._plan()
            spec = sharded_publish.spec(self.model, targets, dtype, self.heads_per_kv, self.head_dim)
            with self.store.writer(version, spec, rank=self.rank, world_size=self.world) as writer:
                self.publish_largest_held = sharded_publish.write_own(
                    self.model,
                    plan,
                    targets,
                    writer,
                    self.rank,
                    dtype,
                    self._block_bytes(),
                    self.heads_per_kv,
                    self.head_dim,
                )
            nbytes = _spec_bytes(spec)
        elapsed = time.perf_counter() - start
        return dict(
            version=version,
            push_s=elapsed,
            bytes=nbytes,
            gb_per_s=nbytes / elapsed / 1e9,
            largest_held_bytes=self.publish_largest_held,
        )  # one block of rows at most, on any rank

    def _publish_dtype(self) -> torch.dtype:
        return getattr(torch, self.cfg.publish_dtype or self.cfg.dtype)  # fp32 masters -> the generators' dtype

    def _block_bytes(self) -> int:
        return int(self.cfg.publish_block_mb * 2**20)

    def _plan(self) -> sharded_publish.Plan:
        if self._publish_plan is None:  # a collective: every rank's boxes, once for the run
            self._publish_plan = sharded_publish.plan(self.model, self.world)
        return self._publish_plan

    def _on_one_host(self) -> bool:
        """Whether every rank runs on this rank's host, by host name (a collective, once): LOCAL_WORLD_SIZE is not
        set by every launcher, and a multi-host trainer taking the single-host path would never complete a
        version."""
        import torch.distributed as dist

        if self._ranks_share_host is None:
            names: list[str] = [None] * self.world  # type: ignore[list-item]
            dist.all_gather_object(names, os.environ.get("FORGE_RL_HOST_ID") or socket.gethostname())
            self._ranks_share_host = len(set(names)) == 1
        return self._ranks_share_host

    def _stream_to_rank0(self, open_writer, dtype: torch.dtype, what: str) -> int:
        """Rank 0 writes through `open_writer(spec)` what every rank sends it, a block of rows at a time
        (forge_rl/weights/sharded_publish.py): no rank holds a whole tensor. Returns the bytes written."""
        import torch.distributed as dist

        targets, plan = self._hf_targets(), self._plan()
        spec = sharded_publish.spec(self.model, targets, dtype, self.heads_per_kv, self.head_dim)
        writer, error = contextlib.nullcontext(), None
        if self.rank == 0:
            try:
                writer = open_writer(spec)
            except Exception as e:  # e.g. WeightStoreFull: tell the other ranks, who would wait to send
                error = e
        said = [None if error is None else f"{type(error).__name__}: {error}"]
        dist.broadcast_object_list(said, src=0)
        if error is not None:
            raise error
        if said[0] is not None:
            raise RuntimeError(f"rank 0 could not open {what} for writing: {said[0]}")
        with writer as w:
            if self.rank == 0 and self.cfg.lora.enabled:  # the export of a LoRA run: W + alpha/r B A, block by block
                w = lora.MergingWriter(w, self._peft(self._adapter_tensors()), self.cfg.lora)
            elif self.cfg.lora.enabled:
                self._adapter_tensors()  # the same collective as rank 0's
            self.publish_largest_held = sharded_publish.stream_to_rank0(
                self.model,
                plan,
                targets,
                w,
                self.rank,
                dtype,
                self.device,
                self._block_bytes(),
                self.heads_per_kv,
                self.head_dim,
            )
        return _spec_bytes(spec)

    def _hf_targets(self) -> sharded_publish.Targets:
        """Each parameter's HF names: {None: [name]}, or {"wq": [...], "wk": [...], "wv": [...]} for a fused q/k/v;
        the tied embedding also names lm_head.weight (vLLM's reload wants the head even when tied). LoRA's
        adapters are not HF weights: they are published on their own (_push_adapter) or merged (export)."""
        from forge_rl.models import qwen3_moe  # TorchTitan's MoE: imported where a model is, not by the app's CLI

        targets = {}
        for name, param in self.model.named_parameters():  # a tied weight once
            if is_adapter_key(name):
                continue
            sd_name = state_dict_name(name)  # the adapter's and the checkpoint's name (activation checkpointing)
            if qwen3_moe.expert_param(sd_name) is not None:  # one HF tensor per expert
                targets[name] = {sharded_publish.EXPERTS: qwen3_moe.expert_names(sd_name, param.shape[0])}
                continue
            if sd_name.endswith(fused_qkv.SUFFIX):
                prefix = sd_name[: -len(fused_qkv.SUFFIX)]
                parts = {part: prefix + part + ".weight" for part in fused_qkv.PARTS}
            else:
                parts = {None: sd_name}
            meta = torch.empty(0, device="meta")
            targets[name] = {part: list(self.adapter.to_hf({tt_name: meta})) for part, tt_name in parts.items()}
            if unnamed := [parts[part] for part, names in targets[name].items() if not names]:
                # a weight the generators would never receive: they would serve the checkpoint's forever
                raise RuntimeError(f"publish: trainer parameter {unnamed[0]} has no Hugging Face name")
            for names in targets[name].values():
                if self.tied and names[0] == "model.embed_tokens.weight":
                    names.append("lm_head.weight")
        return targets

    # ---- LoRA -----------------------------------------------------------------------------------

    def _adapter_tensors(self) -> dict[str, torch.Tensor]:
        """The adapters, whole on every rank, TorchTitan's state-dict names (a collective: every rank calls it).
        They are small (rank x the linears' dims)."""
        from torch.distributed.tensor import DTensor

        return {
            state_dict_name(k): (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu()
            for k, v in self.model.named_parameters()
            if is_adapter_key(k)
        }

    def _peft(self, adapters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return lora.to_peft(adapters, self.head_dim, self.heads_per_kv)

    def _push_adapter(self, version: int, dtype: torch.dtype, start: float) -> dict[str, float]:
        """LoRA: publish the adapters alone (PEFT names), whole, from rank 0. They are small, so gathering beats a
        sharded write; the base never changes and is never sent."""
        peft = {k: v.to(dtype).contiguous() for k, v in self._peft(self._adapter_tensors()).items()}
        if self.rank == 0:
            with self.store.writer(version, spec_of(peft)) as writer:
                for name, tensor in peft.items():
                    writer.write(name, tensor)
        nbytes = sum(t.numel() * t.element_size() for t in peft.values())
        elapsed = time.perf_counter() - start
        return dict(version=version, push_s=elapsed, bytes=nbytes, gb_per_s=nbytes / elapsed / 1e9)

    # ---- export ---------------------------------------------------------------------------------

    def _export_hf(self, out_dir: str, dtype: str | None = None) -> str:
        """An HF model directory in `dtype` (default: the publish dtype) of sharded safetensors + config + tokenizer,
        streamed to rank 0 a block at a time; with LoRA the adapters merged in."""
        if dtype is not None and dtype not in ("float32", "bfloat16"):
            raise ValueError(f"export_hf: dtype={dtype!r}; choose 'float32' or 'bfloat16' (or leave it unset)")
        self._stream_to_rank0(
            lambda spec: self._open_export(out_dir, spec),
            getattr(torch, dtype) if dtype else self._publish_dtype(),
            f"the HF export {out_dir}",
        )
        return str(out_dir)

    def _open_export(self, out_dir: str, spec) -> HFExportWriter:
        return HFExportWriter(out_dir, spec, assets_from=self.model_dir, assets=HF_ASSETS)

    # ---- checkpoints ----------------------------------------------------------------------------

    def _model_tensors(self) -> dict[str, torch.Tensor]:
        """The model's state for a checkpoint: the parameters themselves (each rank's shards; DCP loads into them in
        place) and persistent buffers, by their own names; with LoRA the adapters alone (the frozen base comes from
        trainer.model on every start). Not model.state_dict(): its hook gathers every fused q/k/v whole."""
        tensors = {name: p.detach() for name, p in self.model.named_parameters()}
        tensors.update(_persistent_buffers(self.model))
        if self.cfg.lora.enabled:
            tensors = {k: v for k, v in tensors.items() if is_adapter_key(k)}
        return tensors


def _persistent_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The buffers a state dict would hold (TorchTitan's RoPE caches are not among them: every start rebuilds them)."""
    out = {}
    for prefix, module in model.named_modules():
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and name not in module._non_persistent_buffers_set:
                out[f"{prefix}.{name}" if prefix else name] = buf.detach()
    return out


def _spec_bytes(spec) -> int:
    return sum(dtype.itemsize * math.prod(shape) for dtype, shape in spec.values())
