"""The logic of code paths that run only on CUDA, checked on CPU: the trainer's process-group backend (metric
sums are CPU tensors), the vLLM engine's start method once CUDA may have been touched. The GPU itself is
exercised by `make gpu-check` (tests marked `gpu`, gpu_check/__main__.py)."""

import tempfile

import pytest
import torch
import torch.distributed as dist

from forge_rl.actors.generator_engine import engine_start_method
from forge_rl.actors.train_model_build import process_group_backend


def _all_reduce_cpu_metrics(backend: str) -> torch.Tensor:
    """A one-rank group with `backend`, asked to all-reduce a CPU float64 tensor as Trainer.step's metric sums
    are; the group is torn down after."""
    with tempfile.TemporaryDirectory() as tmp:  # the file store removes its file when the group goes
        dist.init_process_group(backend, init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            sums = torch.arange(8, dtype=torch.float64)
            dist.all_reduce(sums)
            return sums
        finally:
            dist.destroy_process_group()


def test_an_accelerator_only_group_refuses_cpu_tensors():
    """What an NCCL-only group (main at 2735c84: init_process_group("nccl")) does with Trainer.step's CPU metric
    sums, reproduced on CPU by a group whose only backend serves CUDA tensors."""
    with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
        _all_reduce_cpu_metrics("cuda:gloo")


def test_the_trainers_cuda_group_also_reduces_cpu_tensors():
    backend = process_group_backend("cuda")
    assert backend == "cpu:gloo,cuda:nccl"
    assert process_group_backend("cpu") == "gloo"
    # this machine's torch has no NCCL: the same device map with gloo standing in for it
    sums = _all_reduce_cpu_metrics(backend.replace("cuda:nccl", "cuda:gloo"))
    assert sums.tolist() == list(range(8))


def test_the_engine_is_spawned_on_cuda_and_forked_on_cpu():
    assert engine_start_method(cuda=True, environ={}) == "spawn"  # a forked child cannot use CUDA
    assert engine_start_method(cuda=False, environ={}) == "fork"  # ~10 s of imports saved per engine start
    for cuda in (True, False):  # the user's (or an earlier engine's) choice stands
        assert engine_start_method(cuda=cuda, environ={"VLLM_WORKER_MULTIPROC_METHOD": "spawn"}) is None


def test_the_generator_asks_for_a_gpu_without_initialising_cuda(monkeypatch):
    from forge_rl.actors.generator_engine import cuda_visible

    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK", raising=False)
    assert cuda_visible() is torch.cuda.is_available()
    import os

    assert os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] == "1"  # torch asks NVML, not the CUDA runtime
    assert not torch.cuda.is_initialized()
