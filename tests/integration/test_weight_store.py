"""The weight store: versions in shared memory, sharded writers, atomic publish, retention,
cleanup (normal, exception, killed writer, dead run), and the cross-host RDMA path."""

import asyncio
import errno
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import monarch.actor
import pytest
import torch
from safetensors.torch import load_file

from forge_rl.runtime import provisioned
from forge_rl.weights import (
    ShmWeightStore,
    VersionUnavailable,
    WeightMismatch,
    WeightStoreConfig,
    WeightStoreFull,
    cleanup_stale_runs,
    spec_of,
)
from forge_rl.weights import spares
from tests.conftest import REPO, run, small_tmpfs
from tests.support.weight_store_procs import Reader, Writer, model_state, uniform_state


def leftovers(run_id: str) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"forge_rl-{run_id}-")]


@pytest.fixture
def store():
    s = ShmWeightStore(f"t{uuid.uuid4().hex[:8]}", WeightStoreConfig(keep_versions=2))
    yield s
    s.close()  # the last process of the run removes its shared memory
    assert leftovers(s.run_id) == []


def test_round_trip_is_bit_exact_and_a_valid_safetensors_checkpoint(store):
    state = model_state(seed=1)
    state["model.layers.0.mlp.gate.bias"] = torch.arange(-3, 4, dtype=torch.int64)
    store.publish(1, state)
    loaded = store.load(1, expected=spec_of(state))
    for name, t in state.items():
        assert loaded[name].dtype == t.dtype and torch.equal(loaded[name], t), name
    # What vLLM's reload_weights(weights_path=...) reads: a directory of *.safetensors.
    path = store.path(1)
    assert [p.name for p in path.glob("*.safetensors")] == ["model.safetensors"]
    from_disk = load_file(path / "model.safetensors")
    assert from_disk.keys() == state.keys() and all(torch.equal(from_disk[n], state[n]) for n in state)


def test_plain_shards_from_two_writers_make_full_tensors(store):
    full = model_state(seed=2)
    spec = spec_of(full)
    writers = [store.writer(3, spec, rank=r, world_size=2) for r in range(2)]
    for name, t in full.items():
        dim = 1 if t.dim() == 2 and t.shape[1] % 2 else 0  # dim-0 and dim-1 shards, uneven ones too
        cut = (t.shape[dim] + 1) // 2
        for rank, piece in enumerate(t.split(cut, dim)):
            offset = [0] * t.dim()
            offset[dim] = rank * cut
            writers[rank].write(name, piece, offset=tuple(offset))
    writers[0].commit()
    assert store.versions() == [], "visible before every rank committed"
    writers[1].commit()
    loaded = store.load(3)
    assert all(torch.equal(loaded[n], full[n]) for n in full)


def test_a_killed_writers_done_marker_does_not_publish_the_next_attempt_early(store):
    """A trainer killed after its rank 1 committed version 3, but before rank 0 did, leaves rank 1's marker in
    v00000003.tmp. Restarted, it writes version 3 again into the same directory: the version appears only once
    this attempt's rank 1 has committed too, never when rank 0 alone counts the dead rank's marker."""
    script = textwrap.dedent(f"""
        import os, signal, torch
        from forge_rl.weights import ShmWeightStore, WeightStoreConfig
        s = ShmWeightStore({store.run_id!r}, WeightStoreConfig(keep_versions=2))
        w = s.writer(3, {{"w": (torch.float32, (1000,))}}, rank=1, world_size=2)
        w.write("w", torch.full((1000,), 9.0))
        w.commit()
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert [n for n in os.listdir(store.root / "v00000003.tmp") if n.endswith(".done")], "the dead rank's marker"
    spec = {"w": (torch.float32, (1000,))}
    writers = [store.writer(3, spec, rank=r, world_size=2) for r in range(2)]
    writers[0].write("w", torch.ones(500), offset=(0,))
    writers[0].commit()
    assert store.versions() == [], "published before this attempt's rank 1 wrote its half"
    writers[1].write("w", torch.ones(500) * 2, offset=(500,))
    writers[1].commit()
    assert torch.equal(store.load(3)["w"], torch.cat([torch.ones(500), torch.ones(500) * 2]))


def test_retention_keeps_newest_k_and_errors_name_versions(store):
    for v in range(1, 5):
        store.publish(v, uniform_state(v, 16))
    assert store.versions() == [3, 4]
    root_entries = sorted(os.listdir(store.root))
    assert root_entries == ["v00000003", "v00000004"]
    with pytest.raises(VersionUnavailable, match=r"version 1 was dropped.*available: \[3, 4\]"):
        store.load(1)
    with pytest.raises(VersionUnavailable, match=r"version 2 was dropped.*available: \[3, 4\]"):
        store.wait(2, timeout=5)  # fails at once: a newer version exists
    t0 = time.monotonic()
    with pytest.raises(VersionUnavailable, match=r"version 9 was not published within 0.2s.*available: \[3, 4\]"):
        store.wait(9, timeout=0.2)
    assert time.monotonic() - t0 < 2
    with pytest.raises(ValueError, match="version 4 is already published"):
        store.publish(4, uniform_state(4, 16))


def test_new_versions_reuse_the_pages_of_dropped_ones(store):
    inode = lambda v: (store.path(v) / "model.safetensors").stat().st_ino  # noqa: E731
    store.publish(1, uniform_state(1, 1 << 16))
    first = inode(1)
    store.publish(2, uniform_state(2, 1 << 16))
    store.publish(3, uniform_state(3, 1 << 16))  # drops 1 and writes into its file
    assert store.recycled == 1 and inode(3) == first
    loaded = store.load(3)
    assert all(bool((t == 3).all()) for t in loaded.values())
    del loaded
    store.publish(4, uniform_state(4, 1 << 16))
    assert store.recycled == 2 and store.versions() == [3, 4]
    store.publish(5, uniform_state(5, 1 << 12))  # another size: fresh pages
    assert store.recycled == 2 and store.load(5)["t0"].numel() == 1 << 12


def test_the_versions_before_one_is_dropped_take_pages_prepared_ahead(store):
    """Version 2 has no dropped version to recycle (K=2): after version 1, the writer's process prepares its file in
    the background, every page already there; version 2 takes it, version 3 recycles version 1's. The host never
    holds more than K files."""
    store.publish(1, uniform_state(1, 1 << 16))
    store._spares.join()
    (spare,) = spares.ready(store.root)
    made = spare.stat()
    assert made.st_blocks * 512 >= made.st_size > 0  # its pages exist before any version needs them
    assert sorted(os.listdir(store.root)) == [spare.name, "v00000001"]
    store.publish(2, uniform_state(2, 1 << 16))
    assert store.from_spares == 1 and store.recycled == 0 and spares.ready(store.root) == []
    assert (store.path(2) / "model.safetensors").stat().st_ino == made.st_ino
    loaded = store.load(2)
    assert all(bool((t == 2).all()) for t in loaded.values())
    del loaded
    store.publish(3, uniform_state(3, 1 << 16))
    assert (
        store.recycled == 1 and store.from_spares == 1 and sorted(os.listdir(store.root)) == ["v00000002", "v00000003"]
    )


def test_a_pinned_version_is_never_overwritten(store):
    """load() views pin their version while they live, pinned() for a block (vLLM reloading from
    the path); a dropped pinned version is unlinked, not recycled, and its readers keep its bytes."""
    store.publish(1, uniform_state(1, 1 << 16))
    store.publish(2, uniform_state(2, 1 << 16))
    views = store.load(1)
    pinned_inode = (store.path(1) / "model.safetensors").stat().st_ino
    store.publish(3, uniform_state(3, 1 << 16))  # drops 1, cannot recycle it
    assert store.recycled == 0 and (store.path(3) / "model.safetensors").stat().st_ino != pinned_inode
    with store.pinned(2) as path:
        assert (path / "model.safetensors").is_file()
        store.publish(4, uniform_state(4, 1 << 16))  # drops 2, cannot recycle it either
        assert store.recycled == 0
        assert bool((load_file(path / "model.safetensors")["t0"] == 2).all())
    assert all(bool((t == 1).all()) for t in views.values()), "a pinned version was overwritten"
    del views
    store.publish(5, uniform_state(5, 1 << 16))  # 3 is free: recycled
    assert store.recycled == 1 and store.versions() == [4, 5]
    with pytest.raises(VersionUnavailable, match=r"version 3 was dropped"):
        with store.pinned(3):
            pass


def test_loaded_views_are_read_only(store):
    """A stray in-place op on loaded weights crashes the reader instead of changing every reader's weights."""
    store.publish(1, uniform_state(1, 1024))
    code = (
        "import torch\n"
        "from forge_rl.weights import ShmWeightStore\n"
        f"ShmWeightStore({store.run_id!r}).load(1)['t0'].fill_(7.0)\n"
    )
    crashed = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True)
    assert crashed.returncode == -signal.SIGSEGV, crashed.stderr.decode()[-2000:]
    assert all(bool((t == 1).all()) for t in store.load(1).values())


def test_mismatch_names_the_tensor(store):
    state = model_state(seed=3)
    store.publish(1, state)
    expected = spec_of(state)
    expected["model.norm.weight"] = (torch.bfloat16, (16,))
    with pytest.raises(
        WeightMismatch, match=r"'model.norm.weight': stored torch.float32 \[16\], reader expects torch.bfloat16"
    ):
        store.load(1, expected=expected)
    expected = spec_of(state) | {"lm_head.weight": (torch.float32, (64, 8))}
    with pytest.raises(WeightMismatch, match=r"'lm_head.weight'.*\[64, 16\].*\[64, 8\]"):
        store.load(1, expected=expected)
    with pytest.raises(WeightMismatch, match="no tensor 'model.extra'"):
        store.load(1, expected=spec_of(state) | {"model.extra": (torch.float32, (1,))})
    with pytest.raises(WeightMismatch, match="'model.norm.weight': written as torch.float64"):
        with store.writer(2, spec_of(state)) as w:
            w.write("model.norm.weight", state["model.norm.weight"].double())
    with pytest.raises(WeightMismatch, match="'model.norm.weight': shape \\[8\\]"):
        with store.writer(2, spec_of(state)) as w:
            w.write("model.norm.weight", state["model.norm.weight"][:8])
    assert store.versions() == [1] and not list(store.root.glob("*.tmp")), "a failed write was aborted"


def test_a_full_tmpfs_fails_the_publish_by_name_and_keeps_the_previous_version(tmp_path):
    """The store on a real 640 KiB tmpfs holding a 256 KiB filler file: version 1 (~268 KiB) fits,
    version 2 does not. Publishing it, and opening a sharded writer for it as trainer ranks do, fail with
    WeightStoreFull naming the root, the version and the bytes; nothing of version 2 stays behind, and
    version 1 stays whole for the reader holding it and for new ones. Once the filler is gone, version
    2 publishes, and version 3 goes into version 1's pages."""

    def state(v: int) -> dict[str, torch.Tensor]:
        return {"big": torch.randn(1 << 16, generator=torch.Generator().manual_seed(v)), **model_state(v)}

    def free() -> int:
        st = os.statvfs(shm)
        return st.f_bavail * st.f_frsize

    with small_tmpfs(tmp_path / "shm", 640 << 10) as shm:
        with open(shm / "filler", "wb") as f:
            os.posix_fallocate(f.fileno(), 0, 256 << 10)
        store = ShmWeightStore(f"t{uuid.uuid4().hex[:8]}", WeightStoreConfig(keep_versions=2, root=str(shm / "w")))
        try:
            store.publish(1, state(1))
            held = store.load(1)  # a reader (a generator) holding version 1 meanwhile
            free_before = free()
            with pytest.raises(WeightStoreFull) as full:
                store.publish(2, state(2))
            e, message = full.value, str(full.value)
            assert e.errno == errno.ENOSPC and e.version == 2 and e.needed > e.free == free_before, message
            for part in (
                f"weight store {store.root} is full",
                f"weights version 2 needs {e.needed} bytes",
                f"{e.free} bytes",
                "weight_store.keep_versions (now 2",
                "set weight_store.root",
            ):
                assert part in message, message
            assert str(pickle.loads(pickle.dumps(e))) == message  # reaches an endpoint's caller intact
            with pytest.raises(WeightStoreFull, match=f"weights version 2 needs {e.needed} bytes"):
                store.writer(2, spec_of(state(2)), rank=1, world_size=2)
            assert os.listdir(store.root) == ["v00000001"], "a failed version left files behind"
            assert free() == free_before, "a failed version kept pages"
            for got in (held, store.load(1), load_file(store.path(1) / "model.safetensors")):
                assert all(torch.equal(got[n], t) for n, t in state(1).items())
            del held, got
            (shm / "filler").unlink()
            store.publish(2, state(2))
            store.publish(3, state(3))  # drops 1 and recycles its pages: needs no free space
            assert store.versions() == [2, 3] and store.recycled == 1
            assert all(torch.equal(store.load(3)[n], t) for n, t in state(3).items())
        finally:
            store.close()


def test_dtensor_shards_from_two_procs_give_full_tensors_to_the_controller():
    async def body():
        async with provisioned() as prov:
            writer = await Writer.options(procs=2, spmd=True).as_actor()
            placements = [p for _, p in (await writer.write_dtensor_shards.call(7, 11)).items()]
            assert any("Shard(dim=1)" in s for s in placements[0]) and any("Shard(dim=0)" in s for s in placements[0])
            reader = ShmWeightStore(prov.run_id)
            loaded, want = reader.load(7), model_state(11)
            for name in want:
                assert torch.equal(loaded[name], want[name]), name
            assert leftovers(prov.run_id)
            run_id = prov.run_id
        assert leftovers(run_id) == [], "shutdown left shared memory"

    run(body())


def test_reader_racing_a_writer_never_sees_a_mixed_version():
    seen: set[int] = set()

    def read_until(store: ShmWeightStore, done: threading.Event) -> None:
        while not done.is_set():
            available = store.versions()
            if not available:
                time.sleep(0.001)
                continue
            try:
                loaded = store.load(available[-1])
            except VersionUnavailable:
                continue  # dropped between listing and opening: allowed
            for _ in range(2):  # and the views stay that version while held, however many are published
                values = torch.cat(list(loaded.values())).unique().tolist()
                assert values == [available[-1]], f"version {available[-1]} mixed with {values}"
                time.sleep(0.002)  # leaves the GIL to the controller's event loop too
            seen.add(available[-1])

    async def body():
        async with provisioned() as prov:
            writer = await Writer.as_actor(keep_versions=2)
            store, done = ShmWeightStore(prov.run_id), threading.Event()
            reading = asyncio.ensure_future(asyncio.to_thread(read_until, store, done))
            last = 0
            try:
                # 8 MB per version, 10 versions per call, until the reader has seen enough of them:
                # with recycled pages a publish is so fast that a fixed count can finish unobserved.
                while (len(seen) < 8 or last < 20) and last < 1000 and not reading.done():
                    await writer.publish_uniform.call_one(last + 1, last + 10, 1 << 18)
                    last += 10
            finally:
                done.set()
            await reading  # re-raises a mixed read
            assert len(seen) >= 8, f"reader saw too few versions to mean anything: {sorted(seen)}"
            assert store.versions() == [last - 1, last]

    run(body())


def test_runs_one_after_another_in_one_process_get_their_own_shared_memory(monkeypatch):
    """A run id given in the environment names the first run of a process; a second run in that process (a notebook
    running again, the next test module) gets its own, so nothing the first left in /dev/shm is taken for its own."""
    from forge_rl.runtime.reaper import CONTROLLER_ENV
    from forge_rl.weights.runs import RUN_ID_ENV

    given = f"given{uuid.uuid4().hex[:6]}"
    monkeypatch.setenv(RUN_ID_ENV, given)
    monkeypatch.delenv(CONTROLLER_ENV, raising=False)  # as in a process no controller started
    ids = []

    async def body():
        for _ in range(2):
            async with provisioned() as prov:
                ids.append(prov.run_id)

    run(body())
    assert ids[0] == given and ids[1] != given


def test_shutdown_cleans_up_after_exception_and_after_a_killed_writer(monkeypatch):
    # A SIGKILLed proc is a supervision event; outside a Service nobody handles it, and Monarch's
    # default would end the test process.
    monkeypatch.setattr(monarch.actor, "unhandled_fault_hook", lambda failure: None)
    state = {}

    async def body():
        async with provisioned() as prov:
            state["run"] = prov.run_id
            writer = await Writer.as_actor()
            await writer.publish_seeded.call_one(1, 0)
            pid, tmp = await writer.begin_and_stall.call_one(2, 0)
            assert Path(tmp).is_dir()
            os.kill(pid, signal.SIGKILL)
            store = ShmWeightStore(prov.run_id)
            with pytest.raises(VersionUnavailable, match=r"version 2 was not published.*available: \[1\]"):
                await store.wait_async(2, timeout=0.3)
            raise RuntimeError("controller fails on purpose")

    with pytest.raises(RuntimeError, match="on purpose"):
        run(body())
    assert leftovers(state["run"]) == []


def test_next_start_removes_what_a_killed_controller_left():
    run_id = f"dead{uuid.uuid4().hex[:6]}"
    script = textwrap.dedent(f"""
        import os, signal, torch
        from forge_rl.weights import ShmWeightStore
        s = ShmWeightStore({run_id!r})
        s.publish(1, {{"w": torch.ones(1000)}})
        w = s.writer(2, {{"w": (torch.float32, (1000,))}})
        os.kill(os.getpid(), signal.SIGKILL)  # dies mid-write, no cleanup runs
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert len(leftovers(run_id)) == 2  # the version directory and the process registry
    assert any(e.endswith(".tmp") for e in os.listdir(f"/dev/shm/forge_rl-{run_id}-weights-{os.uname().nodename}"))
    assert run_id in cleanup_stale_runs()
    assert leftovers(run_id) == []
    live = ShmWeightStore(f"live{uuid.uuid4().hex[:6]}")  # a live run must survive the sweep
    live.publish(1, {"w": torch.ones(4)})
    try:
        cleanup_stale_runs()
        assert live.versions() == [1]
    finally:
        live.close()


def test_a_worker_hosts_store_sweeps_what_a_killed_job_left_on_that_host():
    """A Slurm worker node: a generator's store (its own host id, no controller on the node) was SIGKILLed with a
    version in its /dev/shm. The requeued job's first store opened on that node removes it, keeping live runs."""
    dead = f"node{uuid.uuid4().hex[:6]}"
    script = textwrap.dedent(f"""
        import os, signal, torch
        from forge_rl.weights import ShmWeightStore, WeightStoreConfig
        s = ShmWeightStore({dead!r}, WeightStoreConfig(host_id="worker-node-3"))
        s.publish(7, {{"w": torch.ones(1000)}})
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert f"forge_rl-{dead}-weights-worker-node-3" in leftovers(dead)
    live = ShmWeightStore(f"live{uuid.uuid4().hex[:6]}", WeightStoreConfig(host_id="worker-node-3"))
    live.publish(1, {"w": torch.ones(4)})
    requeued = ShmWeightStore(f"requeue{uuid.uuid4().hex[:6]}", WeightStoreConfig(host_id="worker-node-3"))
    try:
        assert leftovers(dead) == []  # the dead job's version and registry: gone
        assert live.versions() == [1]  # a run still alive on the node: untouched
    finally:
        requeued.close()
        live.close()


def test_cross_host_prefetch_reads_over_rdma_into_the_readers_host():
    """Two 'hosts' (Monarch ProcessJob workers with different host ids) on this machine."""
    from monarch.job import ProcessJob

    from forge_rl.weights.rdma import WeightServer

    async def body():
        async with provisioned() as prov:
            env = {"FORGE_RL_RUN_ID": prov.run_id, "PYTHONPATH": os.environ["PYTHONPATH"]}
            jobs = [ProcessJob({"host": 1}, env={**env, "FORGE_RL_HOST_ID": h}) for h in ("trainer-host", "gen-host")]
            meshes = []
            try:
                a, b = (j.state(cached_path=None).host.spawn_procs(per_host={"procs": 1}) for j in jobs)
                meshes = [a, b]
                # 1 MiB buckets: the 10 KB test model still takes one read per bucket path
                cfg = WeightStoreConfig(keep_versions=2, bucket_mb=1)
                writer = a.spawn("writer", Writer)
                await writer.setup.call_one()
                server = a.spawn("server", WeightServer, prov.run_id, cfg)
                reader = b.spawn("reader", Reader, server)
                fetch = asyncio.ensure_future(reader.fetch.call_one(1, 5))  # prefetch waits for the publish
                await asyncio.sleep(0.5)
                await writer.publish_seeded.call_one(1, 5)
                got = await fetch
                assert got["exact"] and got["host"] == "gen-host" and got["versions"] == [1]
                assert "-weights-gen-host/v00000001" in got["path"]
                assert load_file(Path(got["path"]) / "model.safetensors").keys() == model_state(5).keys()
                for v in (2, 3):
                    await writer.publish_seeded.call_one(v, v)
                    assert (await reader.fetch.call_one(v, v))["exact"]
                assert (await reader.fetch.call_one(3, 3))["versions"] == [2, 3]  # retention on the reader host
                err = await reader.fetch_error.call_one(1)  # the reader host has [2, 3]: dropped
                assert err.startswith("weights version 1 was dropped") and "[2, 3]" in err, err
                err = await reader.fetch_error.call_one(4)  # asked of the writers' host, which times out
                assert err.startswith("weights version 4 was not published within 1s on host trainer-host"), err
                assert await server.served_versions.call_one() in ([2, 3], [3])  # v1's mapping let go
            finally:
                for m in meshes:
                    await m.stop()
                for j in jobs:
                    j.kill()
            assert sorted(leftovers(prov.run_id)) == sorted(
                [
                    f"forge_rl-{prov.run_id}-pids",
                    f"forge_rl-{prov.run_id}-weights-gen-host",
                    f"forge_rl-{prov.run_id}-weights-trainer-host",
                ]
            )
            run_id = prov.run_id
        assert leftovers(run_id) == []

    run(body())
