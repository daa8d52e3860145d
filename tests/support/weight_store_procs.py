"""Actors for the weight-store tests (importable by the procs Monarch spawns)."""

import os

import torch
from monarch.actor import Actor, endpoint

from forge_rl.runtime import ForgeActor
from forge_rl.weights import ShmWeightStore, VersionUnavailable, WeightStoreConfig, spec_of


def model_state(seed: int) -> dict[str, torch.Tensor]:
    """A small HF-named state dict with fp32 and bf16 tensors and uneven dims (5, 7) for sharding."""
    g = torch.Generator().manual_seed(seed)
    shapes = {
        "model.embed_tokens.weight": ((64, 16), torch.float32),
        "model.layers.0.self_attn.q_proj.weight": ((16, 16), torch.bfloat16),
        "model.layers.0.mlp.up_proj.weight": ((5, 16), torch.float32),
        "model.layers.0.mlp.down_proj.weight": ((16, 7), torch.bfloat16),
        "model.norm.weight": ((16,), torch.float32),
        "lm_head.weight": ((64, 16), torch.float32),
    }
    return {n: torch.randn(s, generator=g).to(d) for n, (s, d) in shapes.items()}


def uniform_state(version: int, numel: int) -> dict[str, torch.Tensor]:
    """Every element of every tensor equals the version: a mixed read is visible at a glance."""
    return {f"t{i}": torch.full((numel,), float(version)) for i in range(8)}


class Writer(ForgeActor):
    def __init__(self, keep_versions: int = 2):
        self.cfg = WeightStoreConfig(keep_versions=keep_versions)

    @endpoint
    async def setup(self) -> None:
        self.store = ShmWeightStore(cfg=self.cfg)

    @endpoint
    async def publish_seeded(self, version: int, seed: int) -> None:
        self.store.publish(version, model_state(seed))

    @endpoint
    async def publish_uniform(self, first: int, last: int, numel: int) -> None:
        for v in range(first, last + 1):
            self.store.publish(v, uniform_state(v, numel))

    @endpoint
    async def write_dtensor_shards(self, version: int, seed: int) -> list[str]:
        """Each rank of a 2-proc mesh writes its DTensor shards; returns the placements used."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (2,))
        full = model_state(seed)
        cycle = [[Shard(0)], [Shard(1)], [Replicate()]]
        used = []
        with self.store.writer(version, spec_of(full), rank=mesh.get_rank(), world_size=2) as w:
            for i, (name, t) in enumerate(full.items()):
                placements = cycle[i % 3] if t.dim() == 2 else [Shard(0)]
                # src_data_rank=None: every rank slices its shard from its own (identical) copy.
                dt = distribute_tensor(t, mesh, placements, src_data_rank=None)
                w.write(name, dt)
                used.append(f"{name}:{placements[0]!r}")
        return used

    @endpoint
    async def begin_and_stall(self, version: int, seed: int) -> tuple[int, str]:
        """Start writing a version and never commit (the test then kills this proc)."""
        state = model_state(seed)
        self._stalled = self.store.writer(version, spec_of(state))
        self._stalled.write("lm_head.weight", state["lm_head.weight"])
        return os.getpid(), str(self._stalled.tmp)


class Reader(Actor):
    """A generator-side reader on some host; `source` is the WeightServer on the writers' host."""

    def __init__(self, source, keep_versions: int = 2):
        self.store = ShmWeightStore(cfg=WeightStoreConfig(keep_versions=keep_versions), source=source)

    @endpoint
    async def fetch(self, version: int, seed: int) -> dict:
        path = await self.store.prefetch(version, timeout=60)
        loaded, want = self.store.load(version, expected=spec_of(model_state(seed))), model_state(seed)
        exact = all(torch.equal(loaded[n], want[n]) for n in want)
        return {"path": str(path), "exact": exact, "versions": self.store.versions(), "host": self.store.host_id}

    @endpoint
    async def fetch_error(self, version: int) -> str:
        try:
            await self.store.prefetch(version, timeout=1)
        except VersionUnavailable as e:
            return str(e)
        return "no error"

    @endpoint
    async def close(self) -> None:
        self.store.close()
