"""What `make gpu-check` says it can run on a host (gpu_check/tiers.py), from the host's facts: a torch that
vLLM's pin refuses, no CUDA, no vLLM installed, a vLLM that will not import."""

import pytest

from gpu_check.tiers import HostFacts, decide, describe, release, torch_pin_of, vllm_facts

H100 = dict(python="3.12.1", cuda_devices=1, device_name="NVIDIA H100 80GB HBM3", vllm_wanted="vllm==0.32.0")


def tiers(**facts) -> dict:
    return {t.name: t for t in decide(HostFacts(**facts))}


def test_a_site_torch_other_than_vllms_pin_refuses_the_vllm_tier_and_runs_the_rest_on_cuda():
    got = tiers(**H100, torch="2.11.0+cu130", vllm="0.32.0", vllm_torch_pin="2.13.0")
    assert not got["vLLM"].runs
    assert got["vLLM"].why == "torch 2.11.0+cu130 here, vLLM 0.32.0 needs torch 2.13.0"
    assert got["no-vLLM"].runs and got["no-vLLM"].on == "cuda" and got["CPU logic"].runs


def test_without_vllm_installed_the_tier_names_the_gpu_extra_and_its_torch():
    got = tiers(**H100, torch="2.11.0+cu130", vllm=None, vllm_torch_pin="2.13.0")
    why = got["vLLM"].why
    assert not got["vLLM"].runs
    assert "vLLM is not installed (the gpu extra's vllm==0.32.0 needs torch 2.13.0; a wheelhouse leaves it out)" in why
    assert "torch 2.11.0+cu130 here, vLLM 0.32.0 needs torch 2.13.0" in why
    assert got["no-vLLM"].on == "cuda"


def test_without_cuda_the_no_vllm_tier_is_a_cpu_logic_check_and_says_so():
    got = tiers(python="3.12.1", torch="2.13.0+cpu", cuda_devices=0, vllm="0.32.0", vllm_torch_pin="2.13.0")
    assert got["no-vLLM"].runs and got["no-vLLM"].on == "cpu"
    assert "no CUDA device visible" in got["no-vLLM"].why and "no GPU figures" in got["no-vLLM"].why
    assert not got["vLLM"].runs and got["vLLM"].why == "no CUDA device visible (torch.cuda.is_available() is False)"
    asked = tiers(
        python="3.12.1", torch="2.13.0", cuda_devices=0, vllm="0.32.0", vllm_torch_pin="2.13.0", cpu_only_asked=True
    )
    assert asked["vLLM"].why == "--cpu-only was given"


def test_the_vllm_tier_runs_where_the_pin_matches_whatever_the_cuda_build_tag_and_not_when_import_fails():
    ok = tiers(**H100, torch="2.13.0+cu130", vllm="0.32.0", vllm_torch_pin="2.13.0")
    assert ok["vLLM"].runs and ok["vLLM"].on == "cuda"
    broken = tiers(
        **H100,
        torch="2.13.0+cu130",
        vllm="0.32.0",
        vllm_torch_pin="2.13.0",
        vllm_import_error="ImportError: libcudart.so.13: cannot open shared object file",
    )
    assert not broken["vLLM"].runs and broken["vLLM"].why.startswith("`import vllm` fails: ImportError: libcudart")


def test_the_report_says_every_tier_up_front():
    facts = HostFacts(**H100, torch="2.11.0+cu130", vllm=None, vllm_torch_pin="2.13.0")
    text = describe(facts, decide(facts))
    assert text.splitlines()[0] == (
        "gpu-check on this host: Python 3.12.1, torch 2.11.0+cu130, 1 x NVIDIA H100 80GB HBM3, vLLM not installed"
    )
    assert "  no-vLLM tier: runs (1 x NVIDIA H100 80GB HBM3, torch 2.11.0+cu130)" in text
    assert "  vLLM tier: cannot run (vLLM is not installed" in text


def test_torch_pins_are_read_from_requirements_and_this_environments_vllm():
    assert torch_pin_of(["numpy", "torch==2.13.0+cpu", "x"]) == "2.13.0"
    assert torch_pin_of(["torch == 2.13.0 ; platform_system == 'Linux'"]) == "2.13.0"
    assert torch_pin_of(["torch>=2.5", "torchvision==0.28.0"]) is None
    assert release("2.11.0+cu130") == "2.11.0"
    version, pin, wanted = vllm_facts()  # from metadata, vLLM not imported
    assert wanted == "vllm==0.32.0" and pin == "2.13.0"


def test_a_trainer_stack_that_does_not_import_with_this_torch_rules_out_both_gpu_tiers_and_says_why():
    got = tiers(
        **H100,
        torch="2.11.0+cu130",
        vllm=None,
        vllm_torch_pin="2.13.0",
        stack_import_error="ImportError: cannot import name 'DataParallelMeshDims' from 'torch.distributed.fsdp'",
    )
    assert got["CPU logic"].runs and not got["no-vLLM"].runs and not got["vLLM"].runs
    assert got["no-vLLM"].why == (
        "forge_rl's trainer stack does not import with torch 2.11.0+cu130: ImportError: "
        "cannot import name 'DataParallelMeshDims' from 'torch.distributed.fsdp'"
    )


def test_on_torch_2_11_the_no_vllm_tier_runs_and_says_which_torch_names_stand_in():
    got = tiers(
        **H100,
        torch="2.11.0+cu130",
        vllm=None,
        vllm_torch_pin="2.13.0",
        torch_placeholders=("torch.distributed.fsdp.DataParallelMeshDims",),
    )
    assert got["no-vLLM"].runs and got["no-vLLM"].on == "cuda"
    assert got["no-vLLM"].why == (
        "1 x NVIDIA H100 80GB HBM3, torch 2.11.0+cu130; torch 2.11.0 lacks "
        "torch.distributed.fsdp.DataParallelMeshDims, which TorchTitan imports and forge_rl "
        "never uses: a placeholder stands in"
    )


def test_a_torch_without_torchtitans_2_12_name_gets_a_placeholder_that_refuses_to_be_used(monkeypatch):
    import torch.distributed.fsdp as fsdp

    from forge_rl.deps import torch_for_torchtitan

    torch_for_torchtitan.provide()  # torch 2.12+: nothing; 2.11: the placeholder, as forge_rl.deps.torchtitan does
    had = fsdp.DataParallelMeshDims
    assert torch_for_torchtitan.missing() == [] and torch_for_torchtitan.provide() == []  # nothing more to give
    assert fsdp.DataParallelMeshDims is had
    monkeypatch.delattr(fsdp, "DataParallelMeshDims", raising=False)  # as torch 2.11's module is
    assert torch_for_torchtitan.provide() == ["torch.distributed.fsdp.DataParallelMeshDims"]
    stand_in = fsdp.DataParallelMeshDims
    assert stand_in is not had and stand_in.forge_rl_placeholder
    assert (stand_in | None) == (stand_in | None)  # TorchTitan's annotations: `DataParallelMeshDims | None = None`
    with pytest.raises(NotImplementedError, match=r"placeholder forge_rl gave TorchTitan: torch .* \(torch 2.12 or"):
        stand_in(shard=("dp_shard",))


def test_pytests_closing_line_loses_its_rule():
    """`make gpu-check`'s verdict quotes pytest's closing line without its rule of '='."""
    from gpu_check.pytest_report import summary_of

    assert summary_of("....\n==== 2 failed, 2 passed in 45.10s ====\n") == "2 failed, 2 passed in 45.10s"
