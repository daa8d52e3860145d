"""ShmWeightStore: versions as safetensors files in this host's /dev/shm.

    /dev/shm/forge_rl-<run>-weights-<host>/
        v00000005/model.safetensors      published: complete, never written again
        v00000006.tmp/model.safetensors  being written by the trainer ranks (+ a .done marker per rank)

Writer ranks map the same preallocated file and copy their tensors (or DTensor shards, at their
global offsets) into it; the rank that commits last renames the directory to its final name. The
rename is atomic, so a reader sees all of a version or nothing of it. Readers on this host read
the published file in place (zero copy); readers on another host `prefetch` it over Monarch RDMA
into their own host's directory (see rdma.py, rdma_fetch.py) and from then on read that copy the same way.

Retention: when a new version starts, versions beyond the newest K-1 are dropped, so a host never
holds more than K versions (K-1 published + 1 being written). Dropping renames a version away
before deleting it, so no reader ever sees half of one.

Recycling: the new version is written into the pages of the version it replaces. Fresh tmpfs pages
cost more than the copy itself (the kernel allocates and zeroes each one), so reusing them is what
lets publishing run at memcpy speed. A reader pins the file it reads (a shared flock, held while it
maps the file or while vLLM reloads from it); the writer recycles a dropped file only if it can take
the exclusive lock, after renaming it away. A pinned file is unlinked instead (its reader keeps valid
bytes until it lets go, then Linux frees the pages) and the writer allocates fresh pages.

Spares: versions 2..K have no dropped version to recycle; their pages are prepared ahead, in the background after
the first version, so that they too are written at memcpy speed (spares.py).
"""

import asyncio
import contextlib
import errno
import fcntl
import os
import re
import shutil
import socket
import threading
import time
from collections.abc import Mapping
from itertools import count
from pathlib import Path

import torch

from forge_rl.weights import maps, spares
from forge_rl.weights.layout import Layout, create_file, version_dir
from forge_rl.weights.rdma_fetch import fetch
from forge_rl.weights.runs import (
    RUN_ID_ENV,
    SHM_DIR,
    cleanup_stale_runs,
    is_alive,
    process_tag,
    register_process,
    release_process,
    run_prefix,
)
from forge_rl.weights.shards import local_piece, region
from forge_rl.weights.store_config import WeightStoreConfig
from forge_rl.weights.store import (
    TensorSpec,
    VersionUnavailable,
    VersionWriter,
    WeightMismatch,
    WeightStore,
    WeightStoreFull,
    check_spec,
    spec_of,
)

HOST_ID_ENV = "FORGE_RL_HOST_ID"
FILE = "model.safetensors"
_FINAL = re.compile(r"v(\d{8})")
_trash_ids = count()


def default_root(run_id: str, host_id: str) -> Path:
    return SHM_DIR / f"{run_prefix(run_id)}weights-{host_id}"


class ShmWeightStore(WeightStore):
    """The weight store of one run on one host. Create one per process (writers and readers alike).

    `source`: for readers, the `WeightServer` actor on the writers' host; readers on another host
    then prefetch over RDMA. Without one (or on the writers' host) prefetch waits for the local file.
    """

    def __init__(self, run_id: str | None = None, cfg: WeightStoreConfig | None = None, source=None):
        self.run_id = run_id or os.environ.get(RUN_ID_ENV)
        if not self.run_id:
            raise ValueError(f"ShmWeightStore needs a run id (argument or ${RUN_ID_ENV})")
        self.cfg = cfg or WeightStoreConfig()
        self.host_id = self.cfg.host_id or os.environ.get(HOST_ID_ENV) or socket.gethostname()
        self.root = Path(self.cfg.root) if self.cfg.root else default_root(self.run_id, self.host_id)
        self.source = source
        self._source_host: str | None = None
        self.remote_fetches = 0  # versions copied from another host (RDMA)
        # This host's leftovers of dead runs go first: on a worker node of a Slurm job the controller's own sweep
        # (forge_rl/runtime/provisioner.py) never runs, and a node SIGKILLed or preempted, then requeued, would
        # otherwise keep a dead run's versions in its /dev/shm (WeightStoreFull on the next start).
        cleanup_stale_runs()
        register_process(self.run_id)  # before creating anything, so a stale-run sweep never takes it
        self.root.mkdir(parents=True, exist_ok=True)
        self._closed = False
        self.recycled = 0  # versions this process wrote into a dropped version's pages
        self.from_spares = 0  # versions this process wrote into pages prepared ahead (spares.py)
        self._spares: threading.Thread | None = None

    # ------------------------------------------------------------------ writers
    def publish(self, version: int, state_dict: Mapping[str, torch.Tensor]) -> None:
        from torch.distributed.tensor import DTensor

        for name, t in state_dict.items():
            if isinstance(t, DTensor):
                raise TypeError(
                    f"publish() takes full tensors; {name!r} is a DTensor. Call writer(...) from every rank "
                    "(each writes its shard), or full_tensor() first"
                )
        with self.writer(version, spec_of(state_dict)) as w:
            for name, t in state_dict.items():
                w.write(name, t)

    def writer(self, version: int, spec: TensorSpec, rank: int = 0, world_size: int = 1) -> "ShmVersionWriter":
        return ShmVersionWriter(self, version, spec, rank, world_size)

    # ------------------------------------------------------------------ readers
    def versions(self) -> list[int]:
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        return sorted(int(m.group(1)) for n in names if (m := _FINAL.fullmatch(n)))

    def path(self, version: int) -> Path:
        if (found := self._ready(version)) is None:
            raise self._unavailable(version, "has not been published")
        return found

    def wait(self, version: int, timeout: float = 60.0) -> Path:
        deadline, delay = time.monotonic() + timeout, 0.001
        while (found := self._ready(version)) is None:
            if time.monotonic() > deadline:
                raise self._unavailable(version, f"was not published within {timeout:g}s")
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        return found

    async def wait_async(self, version: int, timeout: float = 60.0) -> Path:
        deadline, delay = time.monotonic() + timeout, 0.001
        while (found := self._ready(version)) is None:
            if time.monotonic() > deadline:
                raise self._unavailable(version, f"was not published within {timeout:g}s")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)
        return found

    async def prefetch(self, version: int, timeout: float = 60.0) -> Path:
        """Same host as the writers: wait for the version. Other host: copy it here over RDMA."""
        if (found := self._ready(version)) is not None:
            return found
        if self.source is not None:
            if self._source_host is None:
                self._source_host = await self.source.host_id.call_one()
            if self._source_host != self.host_id:
                path = await fetch(self, version, timeout)
                self.remote_fetches += 1
                return path
        return await self.wait_async(version, timeout)

    def load(self, version: int, expected: TensorSpec | None = None) -> dict[str, torch.Tensor]:
        """Zero-copy views of the version; the file stays pinned while any of them is alive."""
        fd = self.pin(version)
        try:
            layout = Layout.read_fd(fd)
            if expected is not None:
                check_spec(layout.spec, expected, version)
            return layout.views(maps.pinned_view(fd, layout.size))
        except BaseException:
            os.close(fd)
            raise

    @contextlib.contextmanager
    def pinned(self, version: int):
        """A directory holding the version, valid and unchanged for the block even if the version is
        dropped meanwhile: e.g. for vLLM to reload weights from. (A hard link to the pinned file.)"""
        fd = self.pin(version)
        link = self.root / f"{version_dir(version)}.pin-{os.getpid()}-{next(_trash_ids)}"
        try:
            link.mkdir()
            _link_fd(fd, link / FILE)
            yield link
        finally:
            shutil.rmtree(link, ignore_errors=True)
            os.close(fd)

    def pin(self, version: int, writable: bool = False) -> int:
        """An fd on the version's file holding a shared lock: writers do not recycle a pinned file.
        Closing the fd unpins."""
        file = self.path(version) / FILE
        try:
            fd = os.open(file, os.O_RDWR if writable else os.O_RDONLY)
        except FileNotFoundError:
            raise self._unavailable(version, "was dropped while being opened") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            # Locked; but is it still this version's file? A writer renames a file away before it
            # tries to recycle it, so a file still at its published path is safe from then on.
            if os.stat(file).st_ino != os.fstat(fd).st_ino:
                raise FileNotFoundError
        except (BlockingIOError, FileNotFoundError):
            os.close(fd)
            raise self._unavailable(version, "was dropped while being opened") from None
        except BaseException:
            os.close(fd)
            raise
        return fd

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self._spares is not None:
                self._spares.join(timeout=60)  # before the maps go: it maps into the same cache
            maps.forget(self.root)
            release_process(self.run_id)

    # ------------------------------------------------------------------ internals
    def _ready(self, version: int) -> Path | None:
        """The version's directory if published; raise if it can no longer appear."""
        final = self.root / version_dir(version)
        if final.is_dir():
            return final
        available = self.versions()
        if available and available[-1] > version:
            # Versions are published in order: a newer one exists, so this one was dropped (or skipped).
            raise self._unavailable(version, f"was dropped (this store keeps the newest {self.cfg.keep_versions})")
        return None

    def _unavailable(self, version: int, why: str) -> VersionUnavailable:
        return VersionUnavailable(version, self.versions(), f"{why} on host {self.host_id}")

    def _new_file(self, directory: Path, size: int) -> Path:
        """Make room for a new version (keep the newest K-1, so the host holds at most K) and give it
        `directory/FILE` of `size` bytes: the pages of a dropped version if one is free, else fresh."""
        directory.mkdir(exist_ok=True)  # every writer rank of the version shares it
        file = directory / FILE
        if self._spares is not None:
            self._spares.join()  # a spare still being prepared is sooner ready than fresh pages made here
        available = self.versions()
        for version in available[: max(len(available) - (self.cfg.keep_versions - 1), 0)]:
            trash = self._retire(self.root / version_dir(version))
            if trash is None:
                continue
            if not file.exists() and _claim(trash / FILE, size):
                with contextlib.suppress(FileExistsError):  # another writer rank got there first
                    os.link(trash / FILE, file)
                    self.recycled += 1
            shutil.rmtree(trash, ignore_errors=True)
        if not file.exists() and spares.claim(self.root, file):
            self.from_spares += 1
        return file

    def prepare_spares(self, committed: int, size: int) -> None:
        """After version `committed` (of `size` bytes): while fewer than K versions are kept, prepare in the
        background the files of the next ones, so that K files are held (spares.py)."""
        kept = set(self.versions()) | {committed}
        wanted = self.cfg.keep_versions - len(kept) - len(spares.ready(self.root))
        st = os.statvfs(self.root)
        wanted = min(wanted, st.f_bavail * st.f_frsize // size)  # what does not fit now is not tried
        if wanted > 0 and not self._closed and (self._spares is None or not self._spares.is_alive()):
            self._spares = spares.prepare(self.root, size, wanted)

    @contextlib.contextmanager
    def _reserving(self, tmp: Path, version: int, size: int):
        """Around claiming the pages of a new version in `tmp`: if that fails, nothing of the version
        stays behind (its other writer ranks then abort too), and a full filesystem raises
        WeightStoreFull, which says how much was needed and what to do. Published versions are not
        touched either way: the pages are reserved (posix_fallocate) before anything is written, so a
        full tmpfs is this ENOSPC, never a SIGBUS in the middle of a copy."""
        try:
            yield
        except BaseException as e:
            self._remove(tmp)
            if isinstance(e, OSError) and e.errno == errno.ENOSPC and not isinstance(e, WeightStoreFull):
                st = os.statvfs(self.root)  # after the removal: what the next attempt will find
                raise WeightStoreFull(
                    str(self.root), version, size, st.f_bavail * st.f_frsize, self.cfg.keep_versions
                ) from e
            raise

    def _drop_all_but(self, keep: int) -> None:
        available = self.versions()
        for version in available[: max(len(available) - keep, 0)]:
            self._remove(self.root / version_dir(version))

    def _retire(self, path: Path) -> Path | None:
        """Rename a version away (atomic: readers see it gone at once, never half deleted)."""
        trash = path.with_name(f"{path.name}.del-{os.getpid()}-{next(_trash_ids)}")
        try:
            os.rename(path, trash)
        except FileNotFoundError:
            return None  # another process dropped it
        return trash

    def _remove(self, path: Path) -> None:
        if (trash := self._retire(path)) is not None:
            shutil.rmtree(trash, ignore_errors=True)

    def _install(self, tmp: Path, version: int) -> Path:
        """Publish a fully written directory under the version's final name."""
        final = self.root / version_dir(version)
        try:
            os.rename(tmp, final)
        except FileNotFoundError:
            if not final.is_dir():
                raise
            # Another rank (or reader on this host) installed it first.
        except OSError:
            if not final.is_dir():
                raise
            self._remove(tmp)  # ours is a duplicate of what is already published
        self._drop_all_but(self.cfg.keep_versions)
        return final


class ShmVersionWriter(VersionWriter):
    """One rank's writes into `vNNNNNNNN.tmp/model.safetensors`; see ShmWeightStore."""

    def __init__(self, store: ShmWeightStore, version: int, spec: TensorSpec, rank: int, world_size: int):
        if not 0 <= rank < world_size:
            raise ValueError(f"writer rank {rank} is outside world_size {world_size}")
        self.store, self.version, self.rank, self.world_size = store, version, rank, world_size
        if (store.root / version_dir(version)).exists():
            raise ValueError(f"weights version {version} is already published on host {store.host_id}")
        self.layout = Layout.for_spec(spec, {"forge_rl_version": str(version)})
        self.tmp = store.root / f"{version_dir(version)}.tmp"
        with store._reserving(self.tmp, version, self.layout.size):
            create_file(store._new_file(self.tmp, self.layout.size), self.layout)
            views = self.layout.views(maps.writable_map(self.tmp / FILE, self.layout.size))
        self._views: dict[str, torch.Tensor] | None = views

    def write(self, name: str, tensor: torch.Tensor, offset: tuple[int, ...] | None = None) -> None:
        if self._views is None:
            raise RuntimeError(f"writer of weights version {self.version} was already committed or aborted")
        full = self._views.get(name)
        if full is None:
            raise WeightMismatch(f"tensor {name!r} is not in the spec of weights version {self.version}")
        if tensor.dtype != full.dtype:
            raise WeightMismatch(f"tensor {name!r}: written as {tensor.dtype}, the spec says {full.dtype}")
        if offset is None and tensor.shape != full.shape:  # a DTensor's shape is its global shape
            raise WeightMismatch(
                f"tensor {name!r}: shape {list(tensor.shape)}, the spec says {list(full.shape)} "
                "(pass offset= for a shard)"
            )
        piece, at = local_piece(tensor, offset)
        region(full, at, tuple(piece.shape)).copy_(piece.detach())

    def commit(self) -> None:
        self._views = None  # unmap before others may rename and read
        try:
            (self.tmp / f".rank{self.rank:05d}.{process_tag()}.done").touch()
            done = _ranks_done(os.listdir(self.tmp))
        except FileNotFoundError:
            raise RuntimeError(
                f"weights version {self.version} was aborted by another writer rank (or removed at shutdown)"
            ) from None
        if len(done) == self.world_size:  # the last rank to finish publishes
            self.store._install(self.tmp, self.version)
        if self.rank == 0:
            self.store.prepare_spares(self.version, self.layout.size)

    def abort(self) -> None:
        self._views = None
        self.store._remove(self.tmp)


def _ranks_done(names: list[str]) -> set[int]:
    """The writer ranks whose `.rank<N>.<process>.done` marker is among `names` and whose process still runs. A
    marker of a dead process is left from an earlier attempt at the version (a trainer killed while publishing it,
    then restarted): counting it would publish the version before this attempt's rank N has written its part."""
    done = set()
    for name in names:
        if name.startswith(".rank") and name.endswith(".done"):
            rank, _, process = name[len(".rank") : -len(".done")].partition(".")
            if rank.isdigit() and is_alive(process):
                done.add(int(rank))
    return done


def _claim(file: Path, size: int) -> bool:
    """Whether a retired version's file can be recycled: right size, and nobody pins it. Readers pin
    only files at a published path and this one was renamed away first, so none can pin it later."""
    try:
        fd = os.open(file, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return os.fstat(fd).st_size == size
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def _link_fd(fd: int, dst: Path) -> None:
    """Hard-link the open file `fd` at `dst`: through the fd, not a path, because the version may have
    been renamed away since it was pinned. (linkat(AT_SYMLINK_FOLLOW) on /proc/self/fd/N; os.link
    uses linkat only when given a dir fd.)"""
    fds = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.link(str(fd), dst, src_dir_fd=fds, follow_symlinks=True)
    finally:
        os.close(fds)
