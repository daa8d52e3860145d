"""`python -m apps.<algorithm>.main --config FILE key=value ...`: parse, run, and end with a one-line error for
what a user can fix (a config key, a dead role) or exit code 130 when interrupted. Signal handling is installed
explicitly, so a run started in the background (nohup, CI, a Slurm batch step) stops as one in a terminal does."""

import asyncio
import os
import sys
from collections.abc import Awaitable, Callable

from forge_rl.config import ConfigError, parse_args
from forge_rl.launch.signals import handle_stop_signals
from forge_rl.loop.rollout import RewardFailing
from forge_rl.loop.run_folder import RunFinished, RunFolderError
from forge_rl.loop.train_loop import RoleDied


def run_from_command_line(schema: type, main: Callable[[object], Awaitable[dict]], description: str,
                          argv: list[str] | None = None) -> None:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    config = parse_args(schema, argv, description=description)
    handle_stop_signals()
    try:
        summary = asyncio.run(main(config))
    except RunFolderError as e:  # the output folder or the checkpoint to resume: bad input, status 2
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2)
    except RunFinished as e:  # resumed at `steps`: nothing to do, and nothing wrong
        print(e)
        return
    except (ConfigError, RoleDied, RewardFailing) as e:
        raise SystemExit(f"error: {e}")
    except KeyboardInterrupt:
        raise SystemExit(130)
    if isinstance(summary, dict) and summary.get("interrupted"):  # a run that saved and stopped on a signal
        raise SystemExit(130)
