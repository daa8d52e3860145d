"""Across hosts: readers pull a published version's bytes with Monarch RDMA, a few large buckets each.

`WeightServer` runs on the writers' host (one small actor). When a remote reader asks for version v
it waits for v, maps its file and registers one `RDMABuffer` per bucket (cfg.bucket_mb) over it, and
returns those handles. The reader (`fetch` in rdma_fetch.py, called by `ShmWeightStore.prefetch`) reads
every bucket into a same-size file in its own host's store in one RDMA action, then installs it like a
writer would: the local copy is the same safetensors file, published atomically, under the same retention.

The server keeps a version's mapping, and pins its file (see shm.py: writers then do not recycle
its pages), while readers hold a lease on it (between `open_version` and `release`), so a remote read
never races the unmapping or the overwriting of its source, even if the writers drop the version
meanwhile. Leases of readers that died expire after LEASE_S. A version nobody leases is unmapped
as soon as it is dropped or a newer one is served, so the writers can recycle its pages.
"""

import asyncio
import os
import time
from dataclasses import dataclass, field

import torch
from monarch.actor import Actor, concurrent_endpoint, endpoint

from forge_rl.weights.layout import version_dir
from forge_rl.weights.maps import server_map
from forge_rl.weights.rdma_fetch import Missing, RemoteVersion
from forge_rl.weights.shm import ShmWeightStore
from forge_rl.weights.store import VersionUnavailable
from forge_rl.weights.store_config import WeightStoreConfig

LEASE_S = 600.0
SWEEP_S = 0.5


@dataclass
class _Served:
    buf: torch.Tensor
    buffers: list
    leases: list[float] = field(default_factory=list)  # start times of the reads in flight


class WeightServer(Actor):
    """Hands out RDMA handles over the versions published on its host. Spawn one per writer host."""

    def __init__(self, run_id: str | None = None, cfg: WeightStoreConfig | None = None):
        self.store = ShmWeightStore(run_id, cfg)
        self._served: dict[int, _Served] = {}
        self._sweeper: asyncio.Task | None = None

    @endpoint
    async def host_id(self) -> str:
        return self.store.host_id

    @concurrent_endpoint  # waiting for a version must not block other readers' releases
    async def open_version(self, version: int, timeout: float = 60.0) -> "RemoteVersion | Missing":
        try:
            await self.store.wait_async(version, timeout)
            served = self._served.get(version) or self._serve(version)
        except VersionUnavailable as e:
            return Missing(e.available, e.why)
        except FileNotFoundError:  # dropped between the wait and the open
            return Missing(self.store.versions(), f"was dropped on host {self.store.host_id}")
        served.leases.append(time.monotonic())
        await self._sweep()  # what this version supersedes
        if self._sweeper is None:
            self._sweeper = asyncio.create_task(self._sweep_forever())
        return RemoteVersion(version, self.store.host_id, served.buf.numel(), served.buffers)

    @endpoint
    async def release(self, version: int) -> None:
        served = self._served.get(version)
        if served is not None and served.leases:
            served.leases.pop(0)
        await self._sweep()

    @endpoint
    async def served_versions(self) -> list[int]:
        return sorted(self._served)

    def _serve(self, version: int) -> _Served:
        from monarch.rdma import RDMABuffer  # sets process-wide warning filters: imported where RDMA is used

        fd = self.store.pin(version, writable=True)  # RDMA registration wants writable memory
        try:
            buf = server_map(fd, os.fstat(fd).st_size)  # unpinned with the map
        except BaseException:
            os.close(fd)
            raise
        step = self.store.cfg.bucket_mb << 20
        buffers = [(start, RDMABuffer(buf[start : start + step])) for start in range(0, buf.numel(), step)]
        self._served[version] = served = _Served(buf, buffers)
        return served

    async def _sweep(self) -> None:
        """Unmap (and unpin) versions no reader is reading once they are dropped or superseded."""
        now = time.monotonic()
        newest = max(self._served, default=None)
        for version, served in list(self._served.items()):
            served.leases = [t for t in served.leases if now - t < LEASE_S]
            gone = version != newest or not (self.store.root / version_dir(version)).is_dir()
            if gone and not served.leases:
                del self._served[version]
                for _, buffer in served.buffers:
                    await buffer.drop()

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_S)
            await self._sweep()
