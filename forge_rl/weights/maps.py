"""Mapping version files into memory: page tables filled once per file, not once per version.

Filling the page tables of a fresh map (4 KiB pages; tmpfs gives no huge pages by default) costs more
than the copy into it. The store recycles the same K files version after version (see shm.py), so each
process keeps its map of each file and reuses it. Writers map shared and writable. Readers map shared
and read-only: a stray in-place op on loaded weights faults (SIGSEGV) instead of silently changing what
every reader sees.

In a process that uses CUDA the map is also page-locked for CUDA (cudaHostRegister, once per file):
GPU <-> host copies from pageable memory go through a staging buffer at a fraction of the speed of
page-locked ones, both ways. FORGE_RL_CUDA_REGISTER=0 turns it off.

A cached map pins nothing: a reader's pin is the locked fd that `load()` ties to its views. A file
that is no longer linked (dropped while someone pinned it, or removed at shutdown) is evicted, so a
cached map never keeps a dropped version's memory alive past the next map call or `forget`.
"""

import mmap
import os
import threading
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux >= 5.14; Python names it from 3.13


CUDA_REGISTER = os.environ.get("FORGE_RL_CUDA_REGISTER", "1") != "0"


@dataclass
class _Map:
    mm: mmap.mmap
    fd: int  # its own open file (no lock on it), to notice when the file is unlinked
    path: str  # where it was first mapped (for forget)
    cuda_ptr: int | None = None  # page-locked for CUDA at this address


_cache: dict[tuple[int, int, bool, int], _Map] = {}
_lock = threading.Lock()  # the cache is also filled by the thread that prepares spare files (spares.py)


def writable_map(path: Path, size: int) -> torch.Tensor:
    """A writer's shared map of the file, as a uint8 tensor."""
    return torch.frombuffer(_map(os.open(path, os.O_RDWR), size, writable=True, path=str(path)), dtype=torch.uint8)


def pinned_view(pin_fd: int, size: int) -> torch.Tensor:
    """A reader's read-only map of the file behind `pin_fd`, as a uint8 tensor. `pin_fd` is closed
    (the pin released) when this tensor and every view of it are gone."""
    # A new open file for the cache, not a dup of pin_fd: a dup would share (and keep) its lock.
    mm = _map(
        os.open(f"/proc/self/fd/{pin_fd}", os.O_RDONLY),
        size,
        writable=False,
        path=os.readlink(f"/proc/self/fd/{pin_fd}"),
    )
    owner = np.frombuffer(mm, dtype=np.uint8)  # one per load: its lifetime is the views' lifetime
    weakref.finalize(owner, os.close, pin_fd)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "non-writable array": on purpose, see above
        return torch.from_numpy(owner)


def server_map(pin_fd: int, size: int) -> torch.Tensor:
    """A writable, uncached map for RDMA registration (which wants writable memory); `pin_fd` is
    closed when the tensor and its views are gone."""
    mm = mmap.mmap(pin_fd, size, flags=mmap.MAP_SHARED)
    weakref.finalize(mm, os.close, pin_fd)
    return torch.frombuffer(mm, dtype=torch.uint8)


def forget(root: Path) -> None:
    """Drop the cached maps of files first mapped under `root` (a store closing)."""
    prefix = str(root) + os.sep
    with _lock:
        for key, m in list(_cache.items()):
            if m.path.startswith(prefix):
                _evict(key)


def _map(fd: int, size: int, writable: bool, path: str) -> mmap.mmap:
    with _lock:
        return _map_unlocked(fd, size, writable, path)


def _map_unlocked(fd: int, size: int, writable: bool, path: str) -> mmap.mmap:
    st = os.fstat(fd)
    key = (st.st_dev, st.st_ino, writable, size)
    _evict_unlinked()
    if (hit := _cache.get(key)) is not None:
        os.close(fd)
        return hit.mm
    try:
        if writable:
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        else:
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
            try:
                mm.madvise(MADV_POPULATE_READ)  # MAP_POPULATE's read-only equivalent
            except OSError:  # kernels before 5.14: pages fault in on first touch instead
                pass
    except BaseException:
        os.close(fd)
        raise
    _cache[key] = _Map(mm, fd, path, _register_with_cuda(mm, writable))
    return mm


def _register_with_cuda(mm: mmap.mmap, writable: bool) -> int | None:
    if not (CUDA_REGISTER and torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None  # a CPU process (or one that has not touched CUDA yet)
    ptr = np.frombuffer(mm, dtype=np.uint8).ctypes.data
    cudart = torch.cuda.cudart()
    flags = 0 if writable else 8  # cudaHostRegisterReadOnly: the reader's map is read-only
    err = cudart.cudaHostRegister(ptr, len(mm), flags)
    if getattr(err, "value", err) != 0:
        warnings.warn(
            f"weight store: cudaHostRegister of a {len(mm) >> 20} MiB map failed ({err}); copies stay pageable",
            stacklevel=2,
        )
        return None
    return ptr


def _evict_unlinked() -> None:
    for key, m in list(_cache.items()):
        if os.fstat(m.fd).st_nlink == 0:
            _evict(key)


def _evict(key) -> None:
    m = _cache.pop(key)
    if m.cuda_ptr is not None:
        torch.cuda.cudart().cudaHostUnregister(m.cuda_ptr)
    os.close(m.fd)  # the map itself goes when the last tensor over it does
