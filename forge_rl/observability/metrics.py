"""One place a run's metrics go: a JSONL file (always), TensorBoard (always), W&B (when a project is set).

    log = MetricsLogger(out_dir, wandb_project=None, resume_step=None)
    log.log(step, {"reward/mean": 0.4, "trainer/loss": 0.1})
    log.close()

A resumed run passes the step it resumed from: metrics.jsonl keeps the rows up to that step and continues,
so nothing past the checkpoint appears twice. A row that a full disk or a kill cut short at the end of the file
is left out when it is read back: the resumed run trains that step again and writes it whole.
"""

import contextlib
import json
import math
import threading
import weakref
from pathlib import Path

from forge_rl.errors import disk_refused


class MetricsLogger:
    def __init__(
        self,
        out_dir: str | Path,
        wandb_project: str | None = None,
        config: dict | None = None,
        resume_step: int | None = None,
    ):
        from torch.utils.tensorboard import SummaryWriter

        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.path = self.out / "metrics.jsonl"
        self.records: list[dict] = []
        self._failed = False
        if resume_step is not None and self.path.is_file():
            self.records = [r for r in read_jsonl(self.path) if r["step"] <= resume_step]
        self._file = self.path.open("w")
        for record in self.records:
            self._file.write(json.dumps(record) + "\n")
        before = set(threading.enumerate())
        self._tb = SummaryWriter(str(self.out / "tensorboard"))
        _quiet_writer_threads(set(threading.enumerate()) - before)
        self._wandb = None
        if wandb_project:
            import wandb  # optional: only imported when configured

            self._wandb = wandb.init(project=wandb_project, config=config or {}, dir=str(self.out))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        clean = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        self.records.append({"step": step, **clean})
        with self._naming(self.path):
            self._file.write(json.dumps(self.records[-1]) + "\n")
            self._file.flush()
        with self._naming(self.out / "tensorboard"):  # its writer thread's error surfaces here, a step later
            for key, value in clean.items():
                self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(clean, step=step)

    def close(self) -> None:
        """Close the files. A write that failed in log() (a full disk) is not raised again; one that fails only
        now (TensorBoard's last events) is."""
        failed_before = self._failed
        try:
            with self._naming(self.path):
                self._file.close()
            with self._naming(self.out / "tensorboard"):
                self._tb.flush()  # raises what its writer thread met, which close() would drop
                self._tb.close()
        except OSError:
            if not failed_before:
                raise
        finally:
            if self._wandb is not None:
                self._wandb.finish()

    @contextlib.contextmanager
    def _naming(self, path: Path):
        """An OSError raised inside names `path` (a flush's names no file), for the run's one line."""
        try:
            yield
        except OSError as e:
            self._failed = True
            raise OSError(e.errno, e.strerror, e.filename or str(path)) from e


_WRITER_THREADS: "weakref.WeakSet[threading.Thread]" = weakref.WeakSet()
_hooked = False  # threading.excepthook wrapped, once per process


def _quiet_writer_threads(threads: set[threading.Thread]) -> None:
    """TensorBoard writes from threads of its own: a full disk there is raised again by the next log() or close(),
    which ends the run in one line, so the thread's own traceback print above that line is left out."""
    global _hooked
    if not _hooked:  # once per process, for the threads of every logger in it
        default = threading.excepthook

        def hook(args) -> None:
            if not (args.thread in _WRITER_THREADS and disk_refused(args.exc_value)):
                default(args)

        threading.excepthook = hook
        _hooked = True
    _WRITER_THREADS.update(threads)


def read_jsonl(path: str | Path) -> list[dict]:
    """The rows of a metrics file; a last row cut short (a full disk, a kill mid-write) is left out."""
    lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
    rows = [json.loads(line) for line in lines[:-1]]
    try:
        rows += [json.loads(line) for line in lines[-1:]]
    except json.JSONDecodeError:
        pass
    return rows
