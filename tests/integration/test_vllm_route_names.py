"""What Keep Routing's CPU recorder (forge_rl/deps/vllm_routes.py) uses of vLLM's MoE layers is still there. Apart
from tests/unit/deps/test_deps.py because it imports vLLM's model executor in a process of its own (seconds)."""

import subprocess
import sys

from tests.unit.deps.test_deps import RECHECK


def test_vllm_route_recording_names():
    """The recorder's vLLM names; the model runner's batch layout is checked against a real engine
    (tests/unit/models/test_keep_routing.py). In a subprocess: importing vLLM's model executor in the test process
    changes what later engines forked from its procs do (their EngineCore processes were left without their
    VLLM:: names, which the shutdown tests look for)."""
    check = (
        "from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter\n"
        "from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner\n"
        "assert callable(BaseRouter.set_capture_fn)\n"
        "assert isinstance(MoERunner.layer_id, property) and isinstance(MoERunner.is_monolithic, property)\n"
    )
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{done.stderr[-2000:]}\n{RECHECK}"
