"""Metrics sinks (JSONL, TensorBoard, W&B when configured) and the end-of-run plots."""

from forge_rl.observability.metrics import MetricsLogger
from forge_rl.observability.plots import plot_run

__all__ = ["MetricsLogger", "plot_run"]
