"""The provisioner: GPU pinning per proc and torch.distributed env inside a mesh."""

import pytest

from forge_rl.runtime import provisioned
from tests.support.actors import DistributedProbe
from tests.conftest import run


def test_each_proc_sees_only_its_own_gpu(monkeypatch):
    # GPU assignment is environment-only, so it can be checked without a GPU.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,6")

    async def body():
        async with provisioned():
            probe = await DistributedProbe.options(procs=2, gpus=True).as_actor()
            seen = [env["CUDA_VISIBLE_DEVICES"] for _, env in (await probe.env.call(["CUDA_VISIBLE_DEVICES"])).items()]
            assert sorted(seen) == ["3", "5"]
            with pytest.raises(RuntimeError, match=r"asks for 2 GPUs \(2 procs x 1\); 1 free"):
                await DistributedProbe.options(procs=2, gpus=True).as_actor()

    run(body())


def test_a_proc_can_have_several_gpus(monkeypatch):
    """A generator replica with vLLM tensor_parallel_size=2: one proc that sees two GPUs."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,6,7,8")

    async def body():
        async with provisioned():
            probe = await DistributedProbe.options(procs=2, gpus=2).as_actor()
            seen = [env["CUDA_VISIBLE_DEVICES"] for _, env in (await probe.env.call(["CUDA_VISIBLE_DEVICES"])).items()]
            assert sorted(seen) == ["3,5", "6,7"]
            with pytest.raises(RuntimeError, match=r"asks for 2 GPUs \(1 procs x 2\); 1 free"):
                await DistributedProbe.options(gpus=2).as_actor()

    run(body())


def test_spmd_mesh_runs_torch_distributed():
    async def body():
        async with provisioned():
            probe = await DistributedProbe.options(procs=2, spmd=True).as_actor()
            envs = [env for _, env in (await probe.env.call(["RANK", "WORLD_SIZE", "MASTER_ADDR"])).items()]
            assert sorted(e["RANK"] for e in envs) == ["0", "1"] and {e["WORLD_SIZE"] for e in envs} == {"2"}
            sums = [v for _, v in (await probe.all_reduce.call(1.5)).items()]
            assert sums == [3.0, 3.0]

    run(body())


def test_each_proc_runs_on_its_cores_with_its_threads():
    """Placement is applied in the proc: affinity, torch threads, and the cores a vLLM CPU engine binds to."""
    import os

    cores = sorted(os.sched_getaffinity(0))
    per_proc = ((cores[0],), (cores[-1],))

    async def body():
        async with provisioned():
            probe = await DistributedProbe.options(procs=2, cpus=per_proc, threads=1).as_actor()
            got = sorted(v for _, v in (await probe.placement.call()).items())
            assert got == sorted(([c], 1) for (c,) in per_proc)
            envs = [env for _, env in (await probe.env.call(["VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS"])).items()]
            assert sorted(e["VLLM_CPU_OMP_THREADS_BIND"] for e in envs) == sorted(str(c) for (c,) in per_proc)
            assert {e["OMP_NUM_THREADS"] for e in envs} == {"1"}
            unpinned = await DistributedProbe.as_actor()
            assert (await unpinned.placement.call_one())[0] == cores
            with pytest.raises(ValueError, match="option cpus has 1 core lists"):
                await DistributedProbe.options(procs=2, cpus=per_proc[:1]).as_actor()

    run(body())
