"""The on-memory format of one version: a plain safetensors file, laid out from the spec alone, in a directory
named after the version (`version_dir`: v00000005).

Because the header depends only on {name: (dtype, shape)}, every writer rank computes the same
layout independently, preallocates the file, and copies its tensors (or shards) straight into
their final bytes through a shared mmap: no pickling, no gather, no per-tensor messages.
The result loads with `safetensors.torch.load_file` and with vLLM's `reload_weights`.
"""

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from forge_rl.weights.store import TensorSpec

_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_BY_NAME = {v: k for k, v in _DTYPES.items()}


def dtype_of(code: str) -> torch.dtype | None:
    """The torch dtype of a safetensors dtype code ("BF16"), or None for one this format does not write."""
    return _BY_NAME.get(code)


@dataclass(frozen=True)
class Entry:
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # byte offset in the file (not in the data section)
    end: int


@dataclass(frozen=True)
class Layout:
    entries: dict[str, Entry]
    header: bytes  # the 8-byte length prefix plus the JSON header
    size: int  # file size in bytes

    @classmethod
    def for_spec(cls, spec: TensorSpec, metadata: dict[str, str] | None = None) -> "Layout":
        # Largest element size first, so that every tensor starts aligned to its own element size
        # (safetensors allows no gaps between tensors, so alignment must come from the order).
        names = sorted(spec, key=lambda n: (-spec[n][0].itemsize, n))
        offsets, pos = {}, 0
        for name in names:
            dtype, shape = spec[name]
            if dtype not in _DTYPES:
                raise ValueError(f"tensor {name!r}: dtype {dtype} has no safetensors encoding")
            nbytes = dtype.itemsize * _numel(shape)
            offsets[name] = (pos, pos + nbytes)
            pos += nbytes
        header = {"__metadata__": {"format": "pt", **(metadata or {})}}
        for name in names:
            dtype, shape = spec[name]
            header[name] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": list(offsets[name])}
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # pad with spaces (allowed by the format): data starts 8-aligned
        base = 8 + len(text)
        entries = {n: Entry(spec[n][0], tuple(spec[n][1]), base + offsets[n][0], base + offsets[n][1]) for n in names}
        return cls(entries, struct.pack("<Q", len(text)) + text, base + pos)

    @classmethod
    def read_fd(cls, fd: int) -> "Layout":
        """The layout of an open safetensors file."""
        (n,) = struct.unpack("<Q", os.pread(fd, 8, 0))
        text = os.pread(fd, n, 8)
        header = json.loads(text)
        header.pop("__metadata__", None)
        base = 8 + n
        entries = {
            name: Entry(
                _BY_NAME[h["dtype"]], tuple(h["shape"]), base + h["data_offsets"][0], base + h["data_offsets"][1]
            )
            for name, h in header.items()
        }
        return cls(entries, struct.pack("<Q", n) + text, os.fstat(fd).st_size)

    @property
    def spec(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        return {n: (e.dtype, e.shape) for n, e in self.entries.items()}

    def views(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        """Typed tensors over a uint8 buffer holding the whole file (zero copy)."""
        return {n: buf[e.start : e.end].view(e.dtype).view(e.shape) for n, e in self.entries.items()}


def version_dir(version: int) -> str:
    if not 0 <= version < 10**8:
        raise ValueError(f"weights version must be in [0, 1e8), got {version}")
    return f"v{version:08d}"


def create_file(path: Path, layout: Layout) -> None:
    """Create (or join, for another writer rank) the file and write its header."""
    allocate_file(path, layout.size)
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, layout.header, 0)  # every rank writes the same bytes
    finally:
        os.close(fd)


def allocate_file(path: Path, size: int) -> None:
    """A file of `size` bytes with every page reserved.

    posix_fallocate reserves the pages now: a full /dev/shm fails here with ENOSPC instead of
    killing the writer with SIGBUS halfway through a copy, and the copies later touch pages that
    already exist (much faster on tmpfs than faulting them in one by one). A recycled file of the
    right size already has all its pages and is left as it is.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        st = os.fstat(fd)
        if st.st_size != size:
            os.ftruncate(fd, size)
        if st.st_size != size or st.st_blocks * 512 < size:
            os.posix_fallocate(fd, 0, size)
    finally:
        os.close(fd)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
