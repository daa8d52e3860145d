"""`python -m apps.<algorithm>.main --config FILE key=value ... [--debug]`: parse, run, and end every mistake a user
can fix with one line, `forge_rl: <what is wrong and what to do>`, on stderr and exit status 2 (config and data
errors: forge_rl/errors.py); a run that stopped for a stated reason (a dead role, a timeout) with its one line and
status 1; an interrupt with status 130. `--debug` (or FORGE_RL_DEBUG=1) shows the traceback before the line.
Anything else is a bug and keeps its traceback. Signal handling is installed explicitly, so a run started in the
background (nohup, CI, a Slurm batch step) stops as one in a terminal does."""

import asyncio
import os
import sys
import traceback
from collections.abc import Awaitable, Callable
from typing import NoReturn

from forge_rl.config import command_line, load_config, overrides
from forge_rl.errors import UserError, one_line, stated_error
from forge_rl.launch.signals import handle_stop_signals
from forge_rl.loop.run_folder import RunFinished

DEBUG_ENV = "FORGE_RL_DEBUG"
USER_ERROR_STATUS = 2  # argparse's status for a bad command line: a config or data error is one too
STOPPED_STATUS = 1


def run_from_command_line(
    schema: type, main: Callable[[object], Awaitable[dict]], description: str, argv: list[str] | None = None
) -> None:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    args = command_line(schema, description).parse_args(argv)
    debug = args.debug or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    try:
        config = load_config(schema, args.config, overrides(args))
        handle_stop_signals()
        summary = asyncio.run(main(config))
    except RunFinished as e:  # resumed at `steps`: nothing to do, and nothing wrong
        print(e)
        return
    except KeyboardInterrupt:
        raise SystemExit(130) from None
    except Exception as e:
        end_on(e, debug)
    if isinstance(summary, dict) and summary.get("interrupted"):  # a run that saved and stopped on a signal
        raise SystemExit(130)


def end_on(error: Exception, debug: bool) -> NoReturn:
    """Exit with the one line of the user error or stop reason `error` carries; re-raise anything else."""
    stated = stated_error(error)
    if stated is None:
        raise error
    if debug:
        traceback.print_exception(error)
    print(f"forge_rl: {one_line(stated)}", file=sys.stderr, flush=True)
    raise SystemExit(USER_ERROR_STATUS if isinstance(stated, UserError) else STOPPED_STATUS)
