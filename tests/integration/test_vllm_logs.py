"""vLLM's console output under forge_rl: warnings only, without the known harmless reload warning."""

import subprocess
import sys

import pytest

from tests.conftest import REPO

SCRIPT = """
from forge_rl.observability.vllm_logs import quiet_vllm
quiet_vllm({level!r})
from vllm.config.logging import LoggingConfig
from vllm.logger import configure_logging, init_logger
configure_logging(LoggingConfig())  # what vLLM's engine and its processes do at start, from the environment
log = init_logger("vllm.model_executor.model_loader.reload.layerwise")
log.info("setting pause state to PAUSED_ALL")
log.warning("%s: Failed to load weights", "RotaryEmbedding")
log.warning("a warning worth reading")
"""


@pytest.mark.parametrize("level", ["WARNING", "INFO"])
def test_vllm_logs_at_the_configured_level_without_known_noise(level):
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(level=level)], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "a warning worth reading" in out.stdout
    assert "Failed to load weights" not in out.stdout + out.stderr
    assert ("PAUSED_ALL" in out.stdout) == (level == "INFO")


def test_a_bad_log_level_names_the_key():
    from forge_rl.observability.vllm_logs import quiet_vllm

    with pytest.raises(ValueError, match="generator.log_level='LOUD'"):
        quiet_vllm("loud")
