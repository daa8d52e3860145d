"""`python -m apps.<algorithm>.main --config FILE key=value ... [--debug]`: parse, run, and end every mistake a user
can fix with one line, `forge_rl: <what is wrong and what to do>`, on stderr and exit status 2 (config and data
errors: forge_rl/errors.py); a run that stopped for a stated reason (a dead role, a timeout, a full disk) with its
one line and status 1; an interrupt with status 130. `--debug` (or FORGE_RL_DEBUG=1) shows the traceback before
the line. Anything else is a bug in forge_rl: one line says so, names the exception and the forge_rl frame it came from,
and where its traceback was written (the run's output_dir, else the temporary directory) to report it.
Signal handling is installed explicitly, so a run started in the background (nohup, CI, a Slurm batch step)
stops as one in a terminal does."""

import asyncio
import logging
import os
import re
import sys
import tempfile
import time
import traceback
from pathlib import Path
from collections.abc import Awaitable, Callable
from typing import NoReturn

from forge_rl.config import command_line, load_config, overrides
from forge_rl.errors import UserError, disk_refused, no_room_line, one_line, stated_error
from forge_rl.launch.signals import handle_stop_signals
from forge_rl.loop.run_folder import RunFinished

THIS = "forge_rl/recipes/command_line.py"  # its frames wrap every run: not where a bug was raised
DEBUG_ENV = "FORGE_RL_DEBUG"
USER_ERROR_STATUS = 2  # argparse's status for a bad command line: a config or data error is one too
STOPPED_STATUS = 1


def run_from_command_line(
    schema: type, main: Callable[[object], Awaitable[dict]], description: str, argv: list[str] | None = None
) -> None:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    args = command_line(schema, description).parse_args(argv)
    debug = args.debug or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    config = None
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
        end_on(e, debug, output_dir=getattr(config, "output_dir", None))
    if isinstance(summary, dict) and summary.get("interrupted"):  # a run that saved and stopped on a signal
        raise SystemExit(130)


def main_process(
    schema: type, main: Callable[[object], Awaitable[dict]], description: str, argv: list[str] | None = None
) -> NoReturn:
    """`run_from_command_line` as the whole life of an app's process (`python -m apps.<algorithm>.main`), which
    then ends at once with the run's exit status. The interpreter's teardown is skipped: its last garbage
    collection walks every object torch, vLLM and Monarch made (seconds on a small CPU) and Triton's bindings then
    print pages of "leaked" warnings, while the run has closed its files and stopped its processes already."""
    try:
        run_from_command_line(schema, main, description, argv)
        status = 0
    except SystemExit as e:
        status = e.code
    if status is None:
        status = 0
    elif not isinstance(status, int):  # SystemExit("message"), as the interpreter prints it
        print(status, file=sys.stderr)
        status = 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def end_on(error: Exception, debug: bool, output_dir: str | None = None) -> NoReturn:
    """Exit with the one line of the user error or stop reason `error` carries, or with the line of a bug (its
    traceback written to a file in `output_dir`)."""
    stated = stated_error(error)
    if debug:
        traceback.print_exception(error)
    refused = disk_refused(error) if stated is None else None
    if refused is not None:  # a full disk or a read-only folder under the run's output: not a bug
        print(f"forge_rl: {no_room_line(refused, output_dir)}", file=sys.stderr, flush=True)
        raise SystemExit(STOPPED_STATUS)
    if stated is None:
        print(f"forge_rl: {bug_line(error, output_dir)}", file=sys.stderr, flush=True)
        raise SystemExit(STOPPED_STATUS)
    print(f"forge_rl: {one_line(stated)}", file=sys.stderr, flush=True)
    raise SystemExit(USER_ERROR_STATUS if isinstance(stated, UserError) else STOPPED_STATUS)


def bug_line(error: BaseException, output_dir: str | None) -> str:
    """One line for an error no check foresaw: a bug in forge_rl, where it was raised (an actor's error carries the
    remote traceback), and the file its whole traceback went to."""
    text = "".join(traceback.format_exception(error))
    frames = [f for f in re.findall(r'File "[^"]*/(forge_rl/[^"]+)", line (\d+), in (\S+)', text) if f[0] != THIS]
    where = f" in {frames[-1][0]}:{frames[-1][1]} ({frames[-1][2]})" if frames else ""
    innermost = next((e for e in reversed(list(_chain(error))) if str(e).strip()), error)
    message = one_line(getattr(innermost, "exception", None) or innermost)[:300]
    log = _write_traceback(text, output_dir)
    return (
        f"an unexpected {type(innermost).__name__}{where}: {message}. This is a bug in forge_rl, not in your "
        f"config: its traceback is in {log}; please report it with that file (--debug prints it here)"
    )


def _chain(error: BaseException):
    while error is not None:
        yield error
        error = getattr(error, "exception", None) or error.__cause__


def _write_traceback(text: str, output_dir: str | None) -> Path:
    """The traceback in `output_dir` where that folder exists, else in the temporary directory."""
    folder = Path(output_dir) if output_dir and Path(output_dir).is_dir() else Path(tempfile.gettempdir())
    path = folder / f"forge_rl-error-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    try:
        path.write_text(text)
    except OSError:
        path = Path(tempfile.mkstemp(prefix="forge_rl-error-", suffix=".log")[1])
        path.write_text(text)
    return path
