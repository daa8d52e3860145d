"""metrics.jsonl over a crash or a full disk: a write the disk refused names the file; a last row cut short is left
out when read back, so a resumed run continues from whole rows (any other bad row is still an error)."""

import errno
import io
import json
import os

import pytest

from forge_rl.observability.metrics import MetricsLogger, read_jsonl


class RefusingFile(io.StringIO):
    """A file whose disk fills up: writes are buffered, the flush fails with ENOSPC (the fault is injected here;
    tests/integration/test_full_disk.py fills a real tmpfs)."""

    def flush(self):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def close(self):
        self.flush()


def test_a_refused_write_names_the_metrics_file_and_close_does_not_raise_again(tmp_path):
    log = MetricsLogger(tmp_path)
    log.log(1, {"loss": 0.5})
    log._file.close()
    log._file = RefusingFile()
    with pytest.raises(OSError) as refused:
        log.log(2, {"loss": 0.4})
    assert refused.value.errno == errno.ENOSPC and refused.value.filename == str(tmp_path / "metrics.jsonl")
    log.close()  # the run's stop closes it: the row that could not be written is not raised twice
    assert read_jsonl(tmp_path / "metrics.jsonl") == [{"step": 1, "loss": 0.5}]


def test_a_last_row_cut_short_is_left_out_and_a_resume_continues_from_whole_rows(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 1, "loss": 0.5}) + "\n" + json.dumps({"step": 2, "loss": 0.4})[:9])
    assert read_jsonl(path) == [{"step": 1, "loss": 0.5}]
    log = MetricsLogger(tmp_path, resume_step=1)
    log.log(2, {"loss": 0.4})
    log.close()
    assert [r["step"] for r in read_jsonl(path)] == [1, 2] and path.read_text().count("\n") == 2
    path.write_text('{"step": 1\n' + json.dumps({"step": 2}) + "\n")  # cut short in the middle: not a crash's
    with pytest.raises(json.JSONDecodeError):
        read_jsonl(path)


def test_a_writer_threads_full_disk_is_left_to_the_next_log_and_other_thread_errors_still_go_on(monkeypatch):
    import threading

    from forge_rl.observability import metrics

    printed = []  # the hook the process had before: pytest's own here, the interpreter's print in an app
    monkeypatch.setattr(threading, "excepthook", lambda args: printed.append(args.exc_value))
    monkeypatch.setattr(metrics, "_hooked", False)
    writer, other = threading.Thread(), threading.Thread()
    metrics._quiet_writer_threads({writer})  # as MetricsLogger registers TensorBoard's writer threads
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    for thread, error in ((writer, full), (writer, ValueError("a bug")), (other, full)):
        threading.excepthook(threading.ExceptHookArgs((type(error), error, None, thread)))
    assert [type(e) for e in printed] == [ValueError, OSError]  # only the writer's full disk is left out
