"""The errors a run ends on with one line, and how to find them under the wrappers they travel in.

- `UserError`: a mistake in what the user gave, whose message names it (the config key, the file, the row, the
  model path) and says what to do. `ConfigError` (config keys) and `DataError` (data files and rows) are its kinds.
  The apps end on one with `forge_rl: <message>` and exit status 2 (forge_rl/recipes/command_line.py).
- `RunStopped`: a run that stopped for a reason its message states in full (a role died, a call timed out, no
  batch came for too long): one line too, exit status 1.
- A write that a full disk or a read-only file system refused (`disk_refused`) states itself too: the apps end on
  it with one line naming the path and the room there, exit status 1 (`no_room_line`).

An error raised inside an actor reaches the caller wrapped: Monarch's ActorError keeps the original as
`.exception`; asyncio's task groups collect several in `.exceptions`; a handler may chain it (`__cause__`,
`__context__`). `stated_error` looks through all of these, so a bad row found by the dataset actor ends the run
with the same line as one found before any actor started. Anything else is a bug and keeps its traceback.
"""

import difflib
import errno
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

DISK_REFUSALS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)  # what making room (or another folder) fixes


class UserError(ValueError):
    """A mistake the user can fix; the message names what was wrong and what to do."""


class ConfigError(UserError):
    """A config problem, with a message that names the key and its source."""


class DataError(UserError):
    """A source or row that cannot be read; the message names the file (and line, row, column)."""


class RunStopped(RuntimeError):
    """A run stopped for a reason its message states in full (which role, which call, where to resume)."""


def stated_error(error: BaseException) -> UserError | RunStopped | None:
    """The UserError (first) or RunStopped that `error` is or wraps, or None for an error that states nothing."""
    found: RunStopped | None = None
    for e in _wrapped(error):
        if isinstance(e, UserError):
            return e
        if found is None and isinstance(e, RunStopped):
            found = e
    return found


def disk_refused(error: BaseException) -> OSError | None:
    """The OSError of a full disk (ENOSPC, EDQUOT) or a read-only file system (EROFS) that `error` is or wraps (a
    trainer rank's, inside Monarch's ActorError), or None. Of several (a write that failed, then another while
    the run stopped), the first that names its file."""
    refused = [e for e in _wrapped(error) if isinstance(e, OSError) and e.errno in DISK_REFUSALS]
    return next((e for e in refused if e.filename), refused[0] if refused else None)


def free_bytes(path: str | Path) -> int:
    """The room left on the file system of `path` (of its nearest existing folder), 0 when it cannot be read."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return 0


def no_room_line(error: OSError, output_dir: str | None) -> str:
    """One line for a run's output (metrics, plots, the summary) that a full disk or a read-only file system
    refused: where, the room there, and how to go on; the run's checkpoints are as they were."""
    where = error.filename or output_dir or "the run's output folder"
    if error.errno == errno.EROFS:
        why = f"{where} is on a read-only file system"
    else:
        why = f"no space left at {where}: {free_bytes(where) / 2**20:.1f} MiB free ({os.strerror(error.errno)})"
    return (
        f"the run stopped: its output could not be written ({why}); make room there (or set output_dir to another "
        "folder), then run the same command with resume=true to continue from its last checkpoint"
    )


def _wrapped(error: BaseException) -> Iterable[BaseException]:
    """`error` and every exception it carries, outermost first (each once)."""
    seen: set[int] = set()
    todo = [error]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen or not isinstance(e, BaseException):
            continue
        seen.add(id(e))
        yield e
        todo.append(getattr(e, "exception", None))  # Monarch's ActorError: the exception raised in the actor
        todo.extend(getattr(e, "exceptions", ()) or ())  # an ExceptionGroup
        todo.append(e.__cause__)
        if not e.__suppress_context__:
            todo.append(e.__context__)


def one_line(error: BaseException) -> str:
    """The error's message on one line (a YAML parser's, for one, spans several)."""
    return " ".join(part.strip() for part in str(error).splitlines() if part.strip()) or type(error).__name__


def did_you_mean(name: str, valid: Iterable[str], prefix: str = "") -> str | None:
    """ "did you mean 'x', 'y'?" naming the valid names closest to `name`, or None when none is close."""
    close = difflib.get_close_matches(name, list(valid), n=3, cutoff=0.5)
    return f"did you mean {', '.join(repr(prefix + c) for c in close)}?" if close else None
