"""One place a run's metrics go: a JSONL file (always), TensorBoard (always), W&B (when a project is set).

    log = MetricsLogger(out_dir, wandb_project=None, resume_step=None)
    log.log(step, {"reward/mean": 0.4, "trainer/loss": 0.1})
    log.close()

A resumed run passes the step it resumed from: metrics.jsonl keeps the rows up to that step and continues,
so nothing past the checkpoint appears twice.
"""

import json
import math
from pathlib import Path


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
        if resume_step is not None and self.path.is_file():
            self.records = [r for r in read_jsonl(self.path) if r["step"] <= resume_step]
        self._file = self.path.open("w")
        for record in self.records:
            self._file.write(json.dumps(record) + "\n")
        self._tb = SummaryWriter(str(self.out / "tensorboard"))
        self._wandb = None
        if wandb_project:
            import wandb  # optional: only imported when configured

            self._wandb = wandb.init(project=wandb_project, config=config or {}, dir=str(self.out))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        clean = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        self.records.append({"step": step, **clean})
        self._file.write(json.dumps(self.records[-1]) + "\n")
        self._file.flush()
        for key, value in clean.items():
            self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(clean, step=step)

    def close(self) -> None:
        self._file.close()
        self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def read_jsonl(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
