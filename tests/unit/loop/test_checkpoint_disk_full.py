"""A checkpoint that a full disk or a read-only folder stops ends the run in one line (RunStopped) naming where, the
room needed and the checkpoint to continue from; the earlier checkpoint stays intact and no partial one is left.
The fault is injected at the write (a real full tmpfs needs root and a mount)."""

import asyncio
import errno
import os
from pathlib import Path

import pytest

from forge_rl.errors import RunStopped
from forge_rl.loop.checkpoint import commit_checkpoint, newest_intact
from tests.unit.loop.test_run_folder import write_checkpoint


def failing_write(code: int, after_bytes: int):
    async def write(partial: Path) -> None:  # as a trainer rank's DCP write fails, wrapped by the caller
        partial.mkdir(parents=True)
        (partial / "__0_0.distcp").write_bytes(os.urandom(after_bytes))
        try:
            raise OSError(code, os.strerror(code), str(partial / "__0_0.distcp"))
        except OSError as e:
            raise RuntimeError("the Trainer's save failed") from e

    return write


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_a_full_or_read_only_disk_ends_in_one_line_and_keeps_the_last_checkpoint(tmp_path, code):
    first = write_checkpoint(tmp_path, 1, "run-a")
    with pytest.raises(RunStopped) as stopped:
        asyncio.run(commit_checkpoint(tmp_path, 2, "run-a", failing_write(code, 1000)))
    message = str(stopped.value)
    assert "\n" not in message and message.startswith("checkpoint step-2 not written (")
    assert f"continue from {first} with resume=true" in message
    if code == errno.ENOSPC:
        assert "MiB free" in message and ".step-2.run-a.partial/__0_0.distcp" in message
    else:
        assert "read-only file system" in message
    assert newest_intact(tmp_path, "run-a") == (first, [])  # resumable, and nothing half-written left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1"]


def test_another_failure_keeps_its_own_error(tmp_path):
    with pytest.raises(RuntimeError, match="the Trainer's save failed"):
        asyncio.run(commit_checkpoint(tmp_path, 1, "run-a", failing_write(errno.EIO, 10)))
    assert list(tmp_path.iterdir()) == []
