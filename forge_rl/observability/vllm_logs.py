"""vLLM's console output inside forge_rl: warnings and errors, not a page of INFO lines per weight update.

Every weight swap makes vLLM log about eight lines (scheduler pause and unpause, prefix-cache reset,
filesystem type, reload time, a checkpoint-loading progress bar) and a "RotaryEmbedding: Failed to load
weights" WARNING: the rotary embedding's cos/sin cache is computed, not a checkpoint weight, so vLLM puts its
own tensors back, as it should. Over a run, these lines bury the run's own step lines.

`quiet_vllm(level)` sets vLLM's logging (in this process and the engine processes it starts, through the
environment) to `level` (default WARNING) with a filter that drops that one known, harmless warning. Set
`generator.log_level: INFO` to see everything vLLM says.
"""

import json
import logging
import os
import tempfile

KNOWN_HARMLESS = ("RotaryEmbedding: Failed to load weights",)


class KnownNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not any(text in record.getMessage() for text in KNOWN_HARMLESS)


def quiet_vllm(level: str = "WARNING") -> None:
    """Call before vLLM is imported in this process."""
    level = level.upper()
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise ValueError(f"generator.log_level={level!r}: one of DEBUG, INFO, WARNING, ERROR, CRITICAL")
    config = {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {"known_noise": {"()": f"{__name__}.KnownNoise"}},
        "formatters": {
            "vllm": {
                "format": "(vllm %(processName)s pid=%(process)d) %(levelname)s [%(filename)s:%(lineno)d] %(message)s"
            }
        },
        "handlers": {
            "vllm": {
                "class": "logging.StreamHandler",
                "formatter": "vllm",
                "level": level,
                "filters": ["known_noise"],
                "stream": "ext://sys.stdout",
            }
        },
        "loggers": {"vllm": {"handlers": ["vllm"], "level": level, "propagate": False}},
    }
    fd, path = tempfile.mkstemp(prefix="forge_rl-vllm-logging-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(config, f)
    os.environ["VLLM_LOGGING_LEVEL"] = level
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = path
