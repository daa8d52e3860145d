"""What a trainer rank holds when the model does not fit one rank: sharded load, train step, cross-host publish.

    python -m benchmarks.scale_memory [--size 1b|0.6b|debug] [--no-train] [--seqs 2] [--tokens 32]

Needs root and the test Slurm cluster's packages (tests/support/slurm_cluster.py; `make setup-slurm`). It writes a
random-init
Qwen3-shaped checkpoint (bf16 safetensors, several files) into a temp dir, starts a Slurm cluster of network-namespace
hosts (a login host and three nodes, each node with a /dev/shm of its own), and from a controller on the login host
runs, through the same launcher as `launcher.kind=slurm`: a trainer of 2 ranks on 2 nodes (FSDP2 across hosts, fp32
masters, AdamW) and a reader on the third node that fetches each published version over the weight store's RDMA
path, as a generator does. Per trainer rank (read from /proc: VmHWM, reset before each phase with clear_refs) it
reports the peak RSS at load, at a train step and at a publish, as a fraction of the model's fp32 bytes 4P, both
whole and above what the rank held before the phase (on CPU the rank's parameters, gradients and AdamW moments are
host memory; on GPUs they are device memory, and the host sees only the phase's extra). Also the bytes the controller
serialises per step for the ranks (forge_rl/runtime/message_bytes.py) against every batch to every rank, and the
seconds of publish and cross-host load per version.

"Before" columns are formulas, the old paths being gone: loading read every file whole on every rank and upcast it
(2P bf16 read + 4P fp32 = 1.5 x 4P per rank); a cross-host publish gathered the whole model in bf16 on every rank
(2P, plus its bf16 shard 2P/W: 0.5 + 0.5/W of 4P above the rank's state); every batch went to every rank (W x).
Results: docs/benchmarks.md. Not a test; heavy: run nothing else meanwhile.
"""

import argparse
import asyncio
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from monarch.actor import Actor, endpoint

from forge_rl.rehearsal.sparse_checkpoint import checkpoint_tensors  # Qwen3's HF tensor shapes

REPO = Path(__file__).resolve().parents[1]

# Qwen3 shapes (hidden, layers, q heads, kv heads, head dim, MLP, vocab); tied embeddings as Qwen3-0.6B/1.7B/4B.
SIZES = {
    "1b": (2048, 14, 16, 8, 128, 6144, 151936),  # Qwen3-1.7B's widths, 14 of its 28 layers: 1.02e9 parameters
    "0.6b": (1024, 28, 16, 8, 128, 3072, 151936),  # Qwen3-0.6B: 0.60e9
    "debug": (256, 2, 4, 2, 64, 768, 151936),  # 0.04e9, to try the script
}
WORLD = 2  # trainer ranks, one per node


def hf_config(size: str) -> dict:
    h, layers, heads, kv, hd, inter, vocab = SIZES[size]
    return dict(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        vocab_size=vocab,
        hidden_size=h,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=hd,
        hidden_act="silu",
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        rope_parameters=dict(rope_type="default", rope_theta=1e6),
        tie_word_embeddings=True,
        attention_bias=False,
        torch_dtype="bfloat16",
        eos_token_id=2,
        pad_token_id=0,
    )


def write_checkpoint(out: Path, size: str) -> int:
    """Random bf16 weights (norms 1), a file per 4 layers so that writing never holds the model; returns P."""
    import torch
    from safetensors.torch import save_file

    cfg = hf_config(size)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    g = torch.Generator().manual_seed(0)
    files: dict[str, dict[str, tuple[int, ...]]] = {}
    for name, shape in checkpoint_tensors(cfg).items():
        layer = name.split(".")[2] if ".layers." in name else "x"
        files.setdefault("x" if layer == "x" else str(int(layer) // 4), {})[name] = shape
    total = 0
    for i, (_, shapes) in enumerate(sorted(files.items())):
        part = {
            n: (torch.ones(s) if n.endswith("norm.weight") else torch.randn(s, generator=g) * 0.02).to(torch.bfloat16)
            for n, s in shapes.items()
        }
        total += sum(t.numel() for t in part.values())
        save_file(part, str(out / f"model-{i:05d}.safetensors"), metadata={"format": "pt"})
        del part
    return total


# ---------------------------------------------------------------- inside the run (the controller, on the login host)
class Probe(Actor):
    """Shares a trainer rank's proc: its pid, host and resident memory before the Trainer exists there."""

    @endpoint
    async def where(self) -> dict:
        import socket

        import forge_rl.actors.trainer  # noqa: F401  the rank's imports, so that the baseline includes them

        return dict(pid=os.getpid(), host=socket.gethostname(), rss=_status(os.getpid())["VmRSS"])


class Reader(Actor):
    """A generator's side of the weight store on its own node: fetch each version from the trainer's host."""

    def __init__(self, server, store_cfg):
        from forge_rl.weights import ShmWeightStore

        self.store = ShmWeightStore(cfg=store_cfg, source=server)

    @endpoint
    async def fetch(self, version: int) -> dict:
        start = time.perf_counter()
        await self.store.prefetch(version, timeout=1800)
        return dict(load_s=time.perf_counter() - start, remote_fetches=self.store.remote_fetches)


def _status(pid: int) -> dict[str, int]:
    """VmRSS, VmHWM (its peak), RssAnon (private) and RssShmem (mapped shared memory) of `pid`, in bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssShmem"):
            out[key] = int(value.split()[0]) * 1024
    return out


class Phase:
    """Memory of each rank during a phase: the kernel's peak RSS (VmHWM, reset before the phase with clear_refs),
    which counts the weight store's /dev/shm pages a writer maps, and the peak of private memory (RssAnon, which has
    no kernel peak: sampled every 10 ms)."""

    def __init__(self, pids: list[int]):
        self.pids = pids

    async def run(self, coro) -> tuple[object, list[dict]]:
        before = []
        for pid in self.pids:
            Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux >= 4.0)
            before.append(_status(pid))
        peaks = [dict(anon=b["RssAnon"], shm=b["RssShmem"]) for b in before]
        done = False

        async def sample():
            while not done:
                for pid, peak in zip(self.pids, peaks):
                    now = _status(pid)
                    peak["anon"], peak["shm"] = max(peak["anon"], now["RssAnon"]), max(peak["shm"], now["RssShmem"])
                await asyncio.sleep(0.01)

        sampler = asyncio.create_task(sample())
        try:
            result = await coro
        finally:
            done = True
            await sampler
        return result, [
            dict(
                before=b["VmRSS"],
                anon_before=b["RssAnon"],
                peak=_status(pid)["VmHWM"],
                anon_peak=pk["anon"],
                shm_peak=pk["shm"],
            )
            for pid, b, pk in zip(self.pids, before, peaks)
        ]


def by_rank(values) -> list:
    """A ValueMesh of a mesh flattened to "rank", as a list in rank order."""
    return [v for _, v in sorted(values.items(), key=lambda item: item[0]["rank"])]


def batches(world: int, seqs: int, tokens: int, vocab: int):
    import torch

    from forge_rl.types import TrainBatch

    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(world):
        mask = torch.zeros(seqs, tokens, dtype=torch.bool)
        mask[:, tokens // 2 :] = True
        out.append(
            TrainBatch(
                torch.randint(3, vocab, (seqs, tokens), generator=g),
                mask,
                -torch.rand(seqs, tokens, generator=g) * mask,
                torch.where(mask, 0, -1),
                torch.randn(seqs, generator=g),
            )
        )
    return out


async def spawn(args, out: Path):
    """The trainer's ranks (a Probe first in each proc), the weight server and the reader."""
    from forge_rl.actors.trainer import Trainer
    from forge_rl.actors.trainer_config import OptimizerConfig, ParallelConfig, TrainerConfig
    from forge_rl.launch.launcher import weight_server
    from forge_rl.runtime.provisioner import get_provisioner
    from forge_rl.weights import WeightStoreConfig

    import benchmarks.scale_memory as me  # actors by their importable name, not __main__

    store_cfg = WeightStoreConfig(keep_versions=1)
    server = await weight_server(store_cfg)
    prov = get_provisioner()
    mesh = await prov.get_proc_mesh(procs=WORLD, mesh_name="Trainer", spmd=True, host_mesh="trainer")
    where = by_rank(await mesh.spawn("probe", me.Probe).flatten("rank").where.call())
    cfg = TrainerConfig(
        model=str(args.model),
        parallel=ParallelConfig(dp_shard=WORLD),
        publish_dtype="bfloat16",
        optim=OptimizerConfig(lr=1e-5),
        checkpoint_dir=str(out / "ckpt"),
    )
    trainer = mesh.spawn("Trainer", Trainer, cfg, store_cfg)
    reader_mesh = await prov.get_proc_mesh(mesh_name="Reader", host_mesh="generator", host_index=0)
    reader = reader_mesh.spawn("reader", me.Reader, server, store_cfg)
    return trainer, reader, where


async def measure(args) -> dict:
    from forge_rl.launch.launcher import run_hosts
    from forge_rl.launch.launcher_config import LauncherConfig, SlurmConfig
    from forge_rl.loop.ranks import Ranks
    from forge_rl.runtime.message_bytes import message_bytes, sent_bytes

    out = Path(args.out)
    launcher = LauncherConfig(
        kind="slurm",
        slurm=SlurmConfig(trainer_nodes=WORLD, generator_nodes=1, time="02:00:00", state_file=str(out / "job.pkl")),
    )
    res: dict = dict(phases={}, publish=[])
    async with run_hosts(launcher, out, out / "logs"):
        trainer, reader, where = await spawn(args, out)
        res["ranks"] = where
        phase = Phase([w["pid"] for w in where])
        _, res["phases"]["load"] = await phase.run(trainer.setup.call())
        res["load_stats"] = by_rank(await trainer.flatten("rank").load_stats.call())
        res["publish"].append(await publish(phase, trainer, reader, 0, res, "publish_v0"))
        if not args.no_train:
            ranks = await Ranks.of(trainer)
            step = batches(WORLD, args.seqs, args.tokens, hf_config(args.size)["vocab_size"])
            with sent_bytes() as wire:
                _, res["phases"]["train"] = await phase.run(
                    asyncio.gather(*(rank.step.call_one(b) for rank, b in ranks.sending(step)))
                )
            res["sent"] = dict(
                after=wire.total,
                per_rank=wire.calls,
                before=WORLD * message_bytes(step),
                each_batch_once=sum(message_bytes([b]) for b in step),
            )
            res["publish"].append(await publish(phase, trainer, reader, 1, res, "publish_v1"))
    return res


async def publish(phase: Phase, trainer, reader, version: int, res: dict, key: str) -> dict:
    pushed, res["phases"][key] = await phase.run(trainer.flatten("rank").push_weights.call(version))
    records = by_rank(pushed)
    fetched = await reader.fetch.call_one(version)
    return dict(
        version=version,
        push_s=records[0]["push_s"],
        bytes=records[0]["bytes"],
        load_s=fetched["load_s"],
        remote_fetches=fetched["remote_fetches"],
        largest_held=[r.get("largest_held_bytes", 0) for r in records],
    )


# ---------------------------------------------------------------- outside: checkpoint, cluster, table
def table(res: dict, params: int, args) -> str:
    fp32 = 4 * params
    frac = lambda b: f"{b / fp32:.3f}"  # noqa: E731
    rows = [
        f"model: {args.size}, P = {params / 1e9:.3f}e9, fp32 4P = {fp32 / 1e9:.2f} GB, world {WORLD} "
        f"(one rank per node), batch {WORLD} x {args.seqs} sequences x {args.tokens} tokens",
        "",
        "| rank (host) | phase | peak RSS / 4P | peak private / 4P | private added / 4P | shm mapped / 4P | "
        "before: added / 4P (formula) |",
        "|---|---|---|---|---|---|---|",
    ]
    before = dict(
        load="1.5 (whole files read, upcast to fp32)",
        train="(unchanged)",
        publish_v0=f"{0.5 + 0.5 / WORLD:.2f} (whole model gathered in bf16)",
        publish_v1=f"{0.5 + 0.5 / WORLD:.2f} (whole model gathered in bf16)",
    )
    for r, w in enumerate(res["ranks"]):
        for name, per_rank in res["phases"].items():
            p = per_rank[r]
            rows.append(
                f"| {r} ({w['host']}) | {name} | {frac(p['peak'])} | {frac(p['anon_peak'])} | "
                f"{frac(p['anon_peak'] - p['anon_before'])} | {frac(p['shm_peak'])} | {before[name]} |"
            )
    rows += [
        "",
        "baseline (a rank's proc with its imports, before the model): "
        + ", ".join(f"rank {r} {w['rss'] / 1e9:.2f} GB" for r, w in enumerate(res["ranks"])),
    ]
    rows += [
        "",
        "load: "
        + "; ".join(
            f"rank {r}: read {s['bytes_read'] / 1e9:.2f} of {s['checkpoint_bytes'] / 1e9:.2f}"
            f" GB, largest read {s['largest_read'] / 1e6:.0f} MB"
            for r, s in enumerate(res["load_stats"])
        ),
        "",
    ]
    rows += [
        "| version | published (GB, bf16) | publish s | cross-host load s | largest block held per rank (MB) |",
        "|---|---|---|---|---|",
    ]
    for p in res["publish"]:
        rows.append(
            f"| {p['version']} | {p['bytes'] / 1e9:.2f} | {p['push_s']:.1f} | {p['load_s']:.1f} | "
            f"{', '.join(f'{b / 1e6:.0f}' for b in p['largest_held'])} |"
        )
    if "sent" in res:
        s = res["sent"]
        rows += [
            "",
            f"controller -> trainer ranks per step: {s['after']} bytes ({s['per_rank']} per rank); each batch "
            f"once would be {s['each_batch_once']}; every batch to every rank was {s['before']} (W x the "
            f"message of all batches)",
        ]
    return "\n".join(rows)


def run_on_cluster(args, model: Path, work: Path) -> dict:
    from tests.support.slurm_cluster import SlurmCluster, missing

    if why := missing():
        sys.exit(f"scale_memory needs the test Slurm cluster: {why}")
    cluster = SlurmCluster(work / "slurm", nodes=WORLD + 1).start()
    try:
        argv = [
            sys.executable,
            "-m",
            "benchmarks.scale_memory",
            "--inner",
            "--size",
            args.size,
            "--model",
            str(model),
            "--out",
            str(work / "run"),
            "--seqs",
            str(args.seqs),
            "--tokens",
            str(args.tokens),
            *(["--no-train"] if args.no_train else []),
        ]
        env = cluster.env(PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
        proc = subprocess.run(
            cluster.on_login(argv),
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            timeout=3600,
        )
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            sys.exit(f"the run failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
        return json.loads(lines[-1][len("RESULT ") :])
    finally:
        cluster.stop()


def memory_needed(size: str, train: bool) -> float:
    """Bytes the run needs at its peak: fp32 params (+ grads and AdamW's two moments when training, and the step's
    transients: 0.7 x 4P per rank measured at 0.6b) over the ranks, the published bf16 version (its tied head
    written twice) on the trainer's node and the reader's copy, and about 0.6 GB per process (the ranks, the reader,
    the weight server, the controller)."""
    cfg = hf_config(size)
    params = sum(math.prod(s) for s in checkpoint_tensors(cfg).values())
    version = 2 * params + 2 * cfg["vocab_size"] * cfg["hidden_size"]
    return (16 + 2 * 0.7 * 4 if train else 4) * params + 2 * version + 5 * 0.6e9


def mem_available() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=SIZES, default="1b")
    ap.add_argument("--no-train", action="store_true", help="load and publish only (no gradients, no AdamW state)")
    ap.add_argument("--seqs", type=int, default=2, help="sequences per rank")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--force", action="store_true", help="run even if the memory it needs is not available")
    ap.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.inner:
        print("RESULT " + json.dumps(asyncio.run(measure(args))), flush=True)
        return
    need, free = memory_needed(args.size, not args.no_train), mem_available()
    print(f"needs about {need / 1e9:.1f} GB of RAM; {free / 1e9:.1f} GB available", flush=True)
    if need > 0.9 * free and not args.force:  # no swap here: running short would OOM-kill someone's processes
        sys.exit(
            f"not enough memory for --size {args.size}{' --no-train' if args.no_train else ''}: "
            "choose a smaller size, --no-train, or --force"
        )
    with tempfile.TemporaryDirectory(prefix="scale_memory-", dir="/tmp") as tmp:
        work = Path(tmp)
        start = time.time()
        params = write_checkpoint(work / "model", args.size)
        print(f"checkpoint: {params / 1e9:.3f}e9 parameters in {time.time() - start:.0f} s", flush=True)
        res = run_on_cluster(args, work / "model", work)
    print(table(res, params, args))
    print(f"\n(total {time.time() - start:.0f} s)")


if __name__ == "__main__":
    main()
