"""A reader's side of a cross-host copy: `fetch` reads a published version from the writers' host over Monarch
RDMA into this host's store (`ShmWeightStore.prefetch` calls it when its `source` is on another host), from the
handles the `WeightServer` there replies with (forge_rl/weights/rdma.py). This module knows the store only
through the object it is given, so the store imports it and not the other way round.
"""

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

from forge_rl.weights.layout import allocate_file, version_dir
from forge_rl.weights.maps import writable_map
from forge_rl.weights.store import VersionUnavailable


@dataclass
class RemoteVersion:
    """What a reader needs to copy one version: file size and (offset, RDMABuffer) per bucket."""

    version: int
    host_id: str
    size: int
    buckets: list[tuple[int, object]]


@dataclass
class Missing:
    """A version the server cannot hand out (sent back as a value: the reader raises it locally)."""

    available: list[int]
    why: str


async def fetch(store, version: int, timeout: float) -> Path:
    """Copy `version` from the source host into the host of `store` (a reader's ShmWeightStore, whose `source` is
    the WeightServer) and install it there."""
    remote = await store.source.open_version.call_one(version, timeout)
    if isinstance(remote, Missing):
        raise VersionUnavailable(version, remote.available, remote.why)
    tmp = store.root / f"{version_dir(version)}.fetch-{os.getpid()}"
    try:
        with store._reserving(tmp, version, remote.size):  # a full reader host: WeightStoreFull
            file = store._new_file(tmp, remote.size)
            allocate_file(file, remote.size)
        buf = writable_map(file, remote.size)
        from monarch.rdma import RDMAAction  # sets process-wide warning filters: imported where RDMA is used

        action = RDMAAction()
        for start, buffer in remote.buckets:
            action.read_remote(buf[start : start + buffer.size()], buffer)
        # Generous: a minute plus the time to move the file at 50 MB/s, slower than even the TCP fallback.
        await action.submit(timeout=int(60 + remote.size / 50e6))
        del buf
        return store._install(tmp, version)
    except BaseException:
        store._remove(tmp)
        raise
    finally:
        # A server that died meanwhile holds no lease; its failure must not hide ours (or our result).
        with contextlib.suppress(Exception):
            await store.source.release.call_one(version)
