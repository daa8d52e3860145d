"""A trained model's weights going out: versions published to the generators through the weight store, an HF model
directory exported, LoRA's adapters as a PEFT directory.

    weights = WeightsOut(model, store_cfg)
    metrics = weights.publish(version)        # every rank calls it: its blocks, straight into the version
    weights.export_hf(out_dir)

The Trainer holds one (forge_rl/actors/trainer.py). Nothing here gathers a sharded parameter whole. Every path works
from each rank's own block of each parameter (forge_rl/weights/sharded_publish.py): on one host every rank writes its
blocks into the version's shared memory; across hosts, and for the export, every rank streams its blocks to rank 0 a
block of rows at a time. TorchTitan's `model.state_dict()` is not used: its hook turns every layer's fused q/k/v into
whole q, k and v tensors on every rank.
"""

import contextlib
import math
import os
import socket
import time
from pathlib import Path

import torch

from forge_rl.actors.train_model import TrainModel
from forge_rl.deps.pytorch import state_dict_name
from forge_rl.models import fused_qkv, lora
from forge_rl.models.lora import is_adapter_key
from forge_rl.weights import ShmWeightStore, WeightStoreConfig, sharded_publish, spec_of
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
    "preprocessor_config.json",  # a vision-language model's processor
    "processor_config.json",
)


class WeightsOut:
    def __init__(self, model: TrainModel, store_cfg: WeightStoreConfig | None = None):
        self.model, self.cfg, self.store_cfg = model, model.cfg, store_cfg
        self.store: ShmWeightStore | None = None  # opened at the first publish
        self._publish_plan: sharded_publish.Plan | None = None  # who writes which block: the boxes never change
        self._ranks_share_host: bool | None = None
        self.largest_held = 0  # the largest piece any publish held: one block of rows at most, on any rank

    # ---- publishing -----------------------------------------------------------------------------

    def publish(self, version: int) -> dict[str, float]:
        """The current weights as `version` (HF names) in the weight store: every rank writes its own blocks of
        each parameter straight into the version's shared-memory file at their global offsets (ranks on several
        hosts: streams them to rank 0), so no rank gathers a tensor; the last rank to finish makes the version
        visible. Returns its timing and bytes."""
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
                lambda spec: self.store.writer(version, spec), dtype, f"weights version {version}", frozen=False
            )
        else:
            targets, plan = self._hf_targets(frozen=False), self._plan()
            spec = sharded_publish.spec(self.model.module, targets, dtype, self.model.heads_per_kv, self.model.head_dim)
            with self.store.writer(version, spec, rank=self.model.rank, world_size=self.model.world) as writer:
                self.largest_held = sharded_publish.write_own(
                    self.model.module,
                    plan,
                    targets,
                    writer,
                    self.model.rank,
                    dtype,
                    self._block_bytes(),
                    self.model.heads_per_kv,
                    self.model.head_dim,
                )
            nbytes = _spec_bytes(spec)
        elapsed = time.perf_counter() - start
        return dict(
            version=version,
            push_s=elapsed,
            bytes=nbytes,
            gb_per_s=nbytes / elapsed / 1e9,
            largest_held_bytes=self.largest_held,
        )

    def release_step_memory(self) -> None:
        """A trainer sharing its GPU gives the step's cached blocks back before the engine wakes up: the caching
        allocator would otherwise keep the step's peak (trainer.release_memory_after_step)."""
        if self.cfg.release_memory_after_step and self.model.device.type == "cuda":
            torch.cuda.empty_cache()

    def close(self) -> None:
        if self.store is not None:
            self.store.close()

    def _publish_dtype(self) -> torch.dtype:
        return getattr(torch, self.cfg.publish_dtype or self.cfg.dtype)  # fp32 masters -> the generators' dtype

    def _block_bytes(self) -> int:
        return int(self.cfg.publish_block_mb * 2**20)

    def _plan(self) -> sharded_publish.Plan:
        if self._publish_plan is None:  # a collective: every rank's boxes, once for the run
            self._publish_plan = sharded_publish.plan(self.model.module, self.model.world)
        return self._publish_plan

    def _on_one_host(self) -> bool:
        """Whether every rank runs on this rank's host, by host name (a collective, once): LOCAL_WORLD_SIZE is not
        set by every launcher, and a multi-host trainer taking the single-host path would never complete a
        version."""
        import torch.distributed as dist

        if self._ranks_share_host is None:
            names: list[str] = [None] * self.model.world  # type: ignore[list-item]
            dist.all_gather_object(names, os.environ.get("FORGE_RL_HOST_ID") or socket.gethostname())
            self._ranks_share_host = len(set(names)) == 1
        return self._ranks_share_host

    def _stream_to_rank0(self, open_writer, dtype: torch.dtype, what: str, frozen: bool = True) -> int:
        """Rank 0 writes through `open_writer(spec)` what every rank sends it, a block of rows at a time
        (forge_rl/weights/sharded_publish.py): no rank holds a whole tensor; `frozen`: trainer.freeze's parameters
        too. Returns the bytes written."""
        import torch.distributed as dist

        targets, plan = self._hf_targets(frozen), self._plan()
        spec = sharded_publish.spec(self.model.module, targets, dtype, self.model.heads_per_kv, self.model.head_dim)
        writer, error = contextlib.nullcontext(), None
        if self.model.rank == 0:
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
            if (
                self.model.rank == 0 and self.cfg.lora.enabled
            ):  # the export of a LoRA run: W + alpha/r B A, block by block
                w = lora.MergingWriter(w, self._peft(self._adapter_tensors()), self.cfg.lora)
            elif self.cfg.lora.enabled:
                self._adapter_tensors()  # the same collective as rank 0's
            self.largest_held = sharded_publish.stream_to_rank0(
                self.model.module,
                plan,
                targets,
                w,
                self.model.rank,
                dtype,
                self.model.device,
                self._block_bytes(),
                self.model.heads_per_kv,
                self.model.head_dim,
            )
        return _spec_bytes(spec)

    def _hf_targets(self, frozen: bool = True) -> sharded_publish.Targets:
        """Each parameter's HF names: {None: [name]}, or {"wq": [...], "wk": [...], "wv": [...]} for a fused q/k/v;
        the tied embedding also names lm_head.weight (vLLM's reload wants the head even when tied). LoRA's
        adapters are not HF weights: they are published on their own (_push_adapter) or merged (export).
        `frozen=False`: trainer.freeze's parameters are left out (a push: the generators keep the checkpoint's)."""
        from forge_rl.models import qwen3_moe  # TorchTitan's MoE: imported where a model is, not by the app's CLI

        targets = {}
        for name, param in self.model.module.named_parameters():  # a tied weight once
            if is_adapter_key(name) or (not frozen and self.cfg.freeze and not param.requires_grad):
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
            targets[name] = {part: list(self.model.adapter.to_hf({tt_name: meta})) for part, tt_name in parts.items()}
            if unnamed := [parts[part] for part, names in targets[name].items() if not names]:
                # a weight the generators would never receive: they would serve the checkpoint's forever
                raise RuntimeError(f"publish: trainer parameter {unnamed[0]} has no Hugging Face name")
            for names in targets[name].values():
                if self.model.tied and names[0].endswith("embed_tokens.weight"):  # a VLM's: model.text_model.
                    names.append("lm_head.weight")
        return targets

    # ---- LoRA -----------------------------------------------------------------------------------

    def _adapter_tensors(self) -> dict[str, torch.Tensor]:
        """The adapters, whole on every rank, TorchTitan's state-dict names (a collective: every rank calls it).
        They are small (rank x the linears' dims)."""
        from torch.distributed.tensor import DTensor

        return {
            state_dict_name(k): (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu()
            for k, v in self.model.module.named_parameters()
            if is_adapter_key(k)
        }

    def _peft(self, adapters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return lora.to_peft(adapters, self.model.head_dim, self.model.heads_per_kv)

    def _push_adapter(self, version: int, dtype: torch.dtype, start: float) -> dict[str, float]:
        """LoRA: publish the adapters alone (PEFT names), whole, from rank 0. They are small, so gathering beats a
        sharded write; the base never changes and is never sent."""
        peft = {k: v.to(dtype).contiguous() for k, v in self._peft(self._adapter_tensors()).items()}
        if self.model.rank == 0:
            with self.store.writer(version, spec_of(peft)) as writer:
                for name, tensor in peft.items():
                    writer.write(name, tensor)
        nbytes = sum(t.numel() * t.element_size() for t in peft.values())
        elapsed = time.perf_counter() - start
        return dict(version=version, push_s=elapsed, bytes=nbytes, gb_per_s=nbytes / elapsed / 1e9)

    # ---- export ---------------------------------------------------------------------------------

    def export_adapter(self, out_dir: str) -> str:
        """LoRA: the adapters as a PEFT adapter directory (adapter_model.safetensors + adapter_config.json), which
        `peft.PeftModel.from_pretrained(base, out_dir)` and vLLM load. Every rank calls it; rank 0 writes."""
        import json

        import torch.distributed as dist
        from safetensors.torch import save_file

        if not self.cfg.lora.enabled:
            raise ValueError("export_adapter: the trainer has no LoRA adapters (trainer.lora.rank is 0)")
        peft = {k: v.contiguous() for k, v in self._peft(self._adapter_tensors()).items()}
        out = Path(out_dir)
        if self.model.rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            save_file(peft, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
            config = self.cfg.lora.peft_config(self.model.model_dir.resolve())
            (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
        dist.barrier()
        return str(out)

    def export_hf(self, out_dir: str, dtype: str | None = None) -> str:
        """An HF model directory in `dtype` (default: the publish dtype) of sharded safetensors + config + tokenizer,
        streamed to rank 0 a block at a time; with LoRA the adapters merged in."""
        if dtype is not None and dtype not in ("float32", "bfloat16"):
            raise ValueError(f"export_hf: dtype={dtype!r}; choose 'float32' or 'bfloat16' (or leave it unset)")
        self._stream_to_rank0(
            lambda spec: self.open_export(out_dir, spec),
            getattr(torch, dtype) if dtype else self._publish_dtype(),
            f"the HF export {out_dir}",
        )
        return str(out_dir)

    def open_export(self, out_dir: str, spec) -> HFExportWriter:
        """The export's writer (the rehearsal records through its own instead)."""
        return HFExportWriter(out_dir, spec, assets_from=self.model.model_dir, assets=HF_ASSETS)


def _spec_bytes(spec) -> int:
    return sum(dtype.itemsize * math.prod(shape) for dtype, shape in spec.values())
