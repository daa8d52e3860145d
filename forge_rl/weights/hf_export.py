"""An HF model directory written a block at a time: sharded safetensors files laid out from the spec alone.

    with HFExportWriter(out_dir, spec, assets_from=model_dir) as writer:   # rank 0
        writer.write("model.layers.0.mlp.up_proj.weight", block, offset=(row, 0))

The export (Trainer.export_hf) streams each rank's shards to rank 0 a block of rows at a time
(forge_rl/weights/sharded_publish.py), and rank 0 copies each block into its place in the files through a shared
map: nobody holds a tensor whole, let alone the model. Tensors go into files of at most `shard_bytes` in name order
(`model-00001-of-0000N.safetensors` plus `model.safetensors.index.json`, as HF's save_pretrained writes them; one
file is `model.safetensors`). The directory is written under a temporary name and renamed when complete, so an
export that fails midway leaves the previous one as it was.
"""

import json
import mmap
import os
import shutil
from pathlib import Path

import torch

from forge_rl.weights.layout import Layout, allocate_file
from forge_rl.weights.shards import local_piece, region

SHARD_BYTES = 5 * 10**9  # HF's default max_shard_size
INDEX = "model.safetensors.index.json"


def shard_files(spec: dict[str, tuple[torch.dtype, tuple[int, ...]]], shard_bytes: int) -> list[dict]:
    """The spec split into files of at most `shard_bytes` (a bigger tensor gets a file of its own), in name order."""
    files, current, size = [], {}, 0
    for name in sorted(spec):
        dtype, shape = spec[name]
        nbytes = dtype.itemsize * torch.Size(shape).numel()
        if current and size + nbytes > shard_bytes:
            files.append(current)
            current, size = {}, 0
        current[name] = spec[name]
        size += nbytes
    return files + [current] if current else files


class HFExportWriter:
    """Rank 0's writer of an HF model directory; `write(name, block, offset)` as the weight store's writers."""

    def __init__(
        self,
        out_dir: str | Path,
        spec: dict[str, tuple[torch.dtype, tuple[int, ...]]],
        assets_from: Path | None = None,
        assets: tuple[str, ...] = (),
        shard_bytes: int = SHARD_BYTES,
    ):
        self.out = Path(out_dir)
        self.tmp = self.out.with_name(self.out.name + ".partial")
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir(parents=True)
        self.assets_from, self.assets = assets_from, assets
        groups = shard_files(spec, shard_bytes)
        names = (
            ["model.safetensors"]
            if len(groups) == 1
            else [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
        )
        self.weight_map = {name: file for file, group in zip(names, groups) for name in group}
        self.total_size = sum(d.itemsize * torch.Size(s).numel() for d, s in spec.values())
        self._views: dict[str, torch.Tensor] = {}
        for file, group in zip(names, groups):
            layout = Layout.for_spec(group)
            path = self.tmp / file
            allocate_file(path, layout.size)  # on a full disk: ENOSPC now, not SIGBUS halfway through a copy
            fd = os.open(path, os.O_RDWR)
            try:
                os.pwrite(fd, layout.header, 0)
                # No MAP_POPULATE (as the weight store's maps have): a file on disk fills the page cache as it is
                # written, not all at once.
                buf = torch.frombuffer(mmap.mmap(fd, layout.size, flags=mmap.MAP_SHARED), dtype=torch.uint8)
            finally:
                os.close(fd)
            self._views.update(layout.views(buf))

    def write(self, name: str, tensor: torch.Tensor, offset: tuple[int, ...] | None = None) -> None:
        full = self._views.get(name)
        if full is None:
            raise KeyError(f"{name!r} is not a tensor of this export")
        if tensor.dtype != full.dtype:
            raise ValueError(f"{name!r}: written as {tensor.dtype}, the export holds {full.dtype}")
        piece, at = local_piece(tensor, offset)
        region(full, at, tuple(piece.shape)).copy_(piece.detach())

    def __enter__(self) -> "HFExportWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._views = {}  # the maps go with their last view
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return
        if len(set(self.weight_map.values())) > 1:
            index = {"metadata": {"total_size": self.total_size}, "weight_map": self.weight_map}
            (self.tmp / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        for name in self.assets:
            if self.assets_from is not None and (self.assets_from / name).is_file():
                shutil.copy(self.assets_from / name, self.tmp / name)
        old = self.out.with_name(self.out.name + ".replaced")
        if self.out.exists():
            shutil.rmtree(old, ignore_errors=True)
            self.out.rename(old)
        self.tmp.rename(self.out)
        shutil.rmtree(old, ignore_errors=True)
