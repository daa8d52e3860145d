"""Several training clients on one base model at once: each client's steps/min beside one client's alone, and what
the service holds meanwhile (its processes and their memory, from /api/v1/healthz).

    python -m benchmarks.tinker_clients [--clients 4] [--steps 8]

One service on the tiny model with LoRA (configs/tinker/tiny.yaml). A step is an RL step of
examples/tinker/rl_addition.py at a small size: save the weights for sampling, sample a group of answers per
problem, forward_backward with importance_sampling on the groups that scored differently, one Adam step. First one
client alone, then `--clients` clients at once, each a process with its own ServiceClient (as separate users' scripts
are). Sampling clients share the service's one generator, training clients its one trainer (LoRA).
"""

import argparse
import multiprocessing
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from benchmarks.tinker_profile import load_example, start_service, stop_service


def run_client(example, info: dict, key: str, steps: int, seed: int, usage: dict | None = None) -> float:
    """One user's loop of `steps` RL steps; returns its steps/min after the first (warm-up) step. With `usage`, the
    service's /healthz just before this client's last step is stored there."""
    import tinker
    from tinker import types

    service = tinker.ServiceClient(base_url=info["base_url"], api_key=key)
    training = service.create_lora_training_client(base_model="tiny", rank=8).result()
    tokenizer = training.get_tokenizer()
    adam = types.AdamParams(learning_rate=1e-3)
    stream = example.problems(8 * steps, seed=seed)
    times = []
    for step in range(steps):
        if usage is not None and step == steps - 1:
            usage.update(health(info, key))
        sampler = training.save_weights_and_get_sampling_client().result()
        groups = example.rollouts(sampler, tokenizer, stream[8 * step : 8 * (step + 1)], 4, 8)
        data = example.datums([g for g in groups if max(g[2]) > min(g[2])])
        if data:
            training.forward_backward(data, "importance_sampling").result()
        training.optim_step(adam).result()
        times.append(time.perf_counter())
    service.close("success").result()
    return 60 * (len(times) - 1) / (times[-1] - times[0])


def health(info: dict, key: str) -> dict:
    return httpx.get(f"{info['base_url']}/api/v1/healthz", headers={"X-API-Key": key}, timeout=60).json()


def client_process(info: dict, key: str, steps: int, seed: int, with_usage: bool) -> tuple[float, dict]:
    """One user's script: run_client in a process of its own; its steps/min, and the service's usage if asked."""
    usage: dict = {}
    rate = run_client(load_example(), info, key, steps, seed, usage if with_usage else None)
    return rate, usage


def concurrent(info: dict, keys: list[str], steps: int) -> tuple[list[float], dict]:
    """Every key's client at once, each a process (as separate users' scripts are: no client waits on another's
    interpreter lock); each one's steps/min, and the service's usage while all of them ran."""
    with ProcessPoolExecutor(len(keys), mp_context=multiprocessing.get_context("spawn")) as pool:
        runs = [pool.submit(client_process, info, key, steps, i, i == 0) for i, key in enumerate(keys)]
        results = [run.result() for run in runs]
    return [rate for rate, _ in results], results[0][1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        overrides = [f"extra_users={args.clients - 1}", f"max_training_clients={args.clients}"]
        proc, info = start_service(Path(tmp), "configs/tinker/tiny.yaml", overrides)
        try:
            (solo,), solo_usage = concurrent(info, [info["api_key"]], args.steps)
            keys = [info["api_key"], *info["other_users"]][: args.clients]
            rates, usage = concurrent(info, keys, args.steps)
        finally:
            stop_service(proc)
    table = Table(title=f"{args.clients} training clients at once on tiny (LoRA rank 8), {args.steps} steps each")
    for column in ("client", "steps/min", "of solo"):
        table.add_column(column, justify="right")
    table.add_row("alone", f"{solo:.1f}", "1.00x")
    for i, rate in enumerate(rates):
        table.add_row(f"{i + 1} of {args.clients}", f"{rate:.1f}", f"{rate / solo:.2f}x")
    table.add_row("median", f"{statistics.median(rates):.1f}", f"{statistics.median(rates) / solo:.2f}x")
    Console().print(table)
    for label, seen in (("alone", solo_usage), (f"{args.clients} at once", usage)):
        names = ", ".join(f"{name} {e['processes']}" for name, e in seen["by_name"].items())
        print(
            f"{label}: {seen['processes']} processes ({names}), {seen['training_clients']} training clients, "
            f"{seen['adapters_served']} adapters on one generator; memory {seen['rss_mib']:.0f} MiB resident, "
            f"{seen['uss_mib']:.0f} MiB unique"
        )


if __name__ == "__main__":
    main()
