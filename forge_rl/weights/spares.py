"""Spare version files: the pages of the versions a store has nothing to recycle for, faulted in ahead.

A publish into fresh tmpfs pages pays for the kernel allocating and zeroing every page, and for mapping them (in a
CUDA process also for page-locking the map); into a recycled version's pages, whose map the writer keeps, it pays for
the copy alone. The store recycles from version K+1 on; versions 2..K
find no dropped version. So when rank 0 commits a version while fewer than K are kept, a thread of its process
prepares the files the next versions will take, while the trainer steps: each the size of the version just written,
its pages reserved and faulted in through the writer's own cached map (page-locked there where CUDA is in use), and
renamed into place only when whole. A writer that needs a fresh file takes a spare first (os.link, so that one
writer rank of several gets it); the generators read the same pages either way. Spares count against the K files a
host holds: K versions kept, spares included.
"""

import contextlib
import os
import threading
import warnings
from itertools import count as counter
from pathlib import Path

import torch

from forge_rl.weights import maps
from forge_rl.weights.layout import allocate_file

PREFIX = "spare-"
_ids = counter()


def ready(root: Path) -> list[Path]:
    """The spares prepared in `root` (not those still being prepared)."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    return sorted(root / n for n in names if n.startswith(PREFIX) and not n.endswith(".tmp"))


def prepare(root: Path, size: int, n: int) -> threading.Thread:
    """Start a thread that prepares `n` spares of `size` bytes in `root`, one after the other."""
    device = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    thread = threading.Thread(target=_make, args=(root, size, n, device), name="forge_rl-spare-pages", daemon=True)
    thread.start()
    return thread


def _make(root: Path, size: int, n: int, device: int | None) -> None:
    if device is not None:
        torch.cuda.set_device(device)  # the map is page-locked for the same device as the writer's maps
    for _ in range(n):
        tmp = root / f"{PREFIX}{os.getpid()}-{next(_ids)}.tmp"
        try:
            allocate_file(tmp, size)
            maps.writable_map(tmp, size)  # MAP_POPULATE: every page zeroed and mapped now; the map stays cached
            os.rename(tmp, tmp.with_suffix(""))
        except OSError as e:  # a full /dev/shm: the next version makes its own pages (or says it is full)
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            warnings.warn(f"weight store: no spare version file prepared in {root}: {e}", stacklevel=2)
            return


def claim(root: Path, file: Path) -> bool:
    """Give `file` (not yet existing) the pages of a spare; False when there is none, or another writer rank of the
    same version placed the file first."""
    for spare in ready(root):
        try:
            os.link(spare, file)
        except FileExistsError:
            return False
        except FileNotFoundError:
            continue  # another writer rank took this one
        with contextlib.suppress(FileNotFoundError):
            os.unlink(spare)
        return True
    return False
