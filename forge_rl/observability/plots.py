"""End-of-run PNG from a run's metrics.jsonl: one panel per group of metric keys (GRPO: reward, accuracy,
throughput, waiting; SFT: loss and accuracy)."""

from pathlib import Path

from forge_rl.observability.metrics import read_jsonl

GRPO_PANELS = (
    ("reward", ["reward/mean", "reward/exact_match", "reward/format"]),
    ("accuracy", ["eval/accuracy", "train/accuracy"]),
    ("throughput (tokens/s)", ["generator/tokens_per_s", "trainer/tokens_per_s"]),
    ("waiting (s per step)", ["buffer/sample_wait_s", "buffer/add_blocked_s", "sync/pause_s"]),
)


SFT_PANELS = (("loss (response tokens)", ["train/loss"]), ("held-out greedy accuracy", ["eval/accuracy"]))


def plot_run(metrics_jsonl: str | Path, out_png: str | Path, title: str = "", panels=GRPO_PANELS) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_jsonl(metrics_jsonl)
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6))
    for ax, (name, keys) in zip(axes, panels):
        for key in keys:
            points = [(r["step"], r[key]) for r in rows if key in r]
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, marker="o" if len(points) < 30 else None, markersize=3, label=key)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out_png)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
