"""Where a run's hosts come from: this machine (`launcher.kind: local`) or a Slurm allocation (`slurm`).

    async with launched(cfg.launcher, out) as hosts, provisioned(hosts=hosts):
        ...  # hosts: {} locally; {"trainer": HostMesh, "generator": HostMesh} on Slurm

With Slurm the app gets one host mesh per role from Monarch's job API (`SlurmHosts`, forge_rl/launch/slurm.py):
`trainer_nodes` nodes for the trainer ranks, `generator_nodes` for the generator replicas; the small actors
(dataset, reward, replay buffer) stay with the controller. Two ways to run, same app and config:

- interactive: the controller runs on a login node; the launcher submits the workers' job (sbatch), waits for
  it, and attaches. The job's state is cached in `launcher.slurm.state_file`, so a re-run (or a notebook) with
  the same settings reattaches to a running allocation instead of queueing again. The job is cancelled when
  the app exits unless `keep_job: true`.
- batch: `python -m forge_rl.launch.launcher submit --config ... key=value` submits one sbatch job that runs
  the workers and the app inside the allocation (Monarch's batch mode; see docs/slurm.md).
"""

import argparse
import asyncio
import contextlib
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from forge_rl.launch.launcher_config import LauncherConfig, SlurmConfig
from forge_rl.launch.signals import die_with_parent

logger = logging.getLogger(__name__)

ROLES = ("trainer", "generator")


def slurm_job(cfg: SlurmConfig, log_dir: str | Path):
    from forge_rl.launch.slurm import SlurmHosts

    return SlurmHosts(
        meshes={"trainer": cfg.trainer_nodes, "generator": cfg.generator_nodes},
        python_exe=cfg.python or sys.executable,
        slurm_args=list(cfg.sbatch_args),
        monarch_port=cfg.port,
        job_name=cfg.job_name,
        time_limit=cfg.time,
        partition=cfg.partition,
        log_dir=str(cfg.log_dir or log_dir),
        exclusive=cfg.exclusive,
        gpus_per_node=cfg.gpus_per_node,
        cpus_per_task=cfg.cpus_per_task,
        mem=cfg.mem,
        job_start_timeout=cfg.start_timeout_s,
        account=cfg.account,
        qos=cfg.qos,
    )


def in_slurm_batch() -> bool:
    """True inside an allocation that `submit` made (Monarch's batch mode): the job's workers are ours."""
    from forge_rl.deps.monarch import in_batch_job

    return in_batch_job()


@contextlib.asynccontextmanager
async def launched(cfg: LauncherConfig, output_dir: str | Path):
    """The run's host meshes by role ({} for local: everything on this host)."""
    if cfg.kind == "local":
        yield {}
        return
    from monarch.job import job_load

    from forge_rl.deps.monarch import slurm_job_id

    if in_slurm_batch():  # inside the allocation `submit` made: the job it cached names our workers
        # The app lives no longer than its job: when Slurm ends or requeues it, the batch runner that started
        # us dies first, and an app outliving it would run on beside the requeued job (launch/signals.py).
        die_with_parent(os.getppid())
        job = job_load(BATCH_STATE_FILE)
        state = job.state(cached_path=None)
        job_id = os.environ["SLURM_JOB_ID"]
    else:
        job = slurm_job(cfg.slurm, Path(output_dir) / "slurm")
        logger.info("waiting for the Slurm allocation (%s)", cfg.slurm.state_file)
        state = job.state(cached_path=cfg.slurm.state_file)  # reattaches to a cached running job, else sbatch
        job_id = slurm_job_id(job)  # this job, or the cached one it reattached to
    watch = asyncio.create_task(stop_before_end(job_id, cfg.slurm.stop_before_end_s))
    try:
        yield {role: getattr(state, role) for role in ROLES}
    finally:
        watch.cancel()
        stopped_for_time = watch.done() and not watch.cancelled() and watch.exception() is None and watch.result()
        if in_slurm_batch():  # the batch runner stops the workers when the app exits
            if stopped_for_time and cfg.slurm.requeue_at_end:
                print(f"requeueing Slurm job {job_id}: it resumes from the checkpoint just written", flush=True)
                subprocess.run(["scontrol", "requeue", job_id], check=False)
        elif not cfg.slurm.keep_job:
            job.kill()  # scancel
            with contextlib.suppress(FileNotFoundError):
                os.remove(cfg.slurm.state_file)


@contextlib.asynccontextmanager
async def run_hosts(cfg: LauncherConfig, output_dir: str | Path, log_dir: str | Path | None):
    """A run's hosts by role (`launched`) and its provisioner on them: `async with run_hosts(...) as (hosts,
    provisioner)`; every proc, mesh and shared-memory file of the run is gone on the way out."""
    from forge_rl.runtime import provisioned

    async with launched(cfg, output_dir) as hosts, provisioned(log_dir=log_dir, hosts=hosts) as provisioner:
        yield hosts, provisioner


async def stop_before_end(job_id: str, margin_s: float) -> bool:
    """Interrupt this process (SIGINT: the app's final-checkpoint path) `margin_s` before the job's time limit.
    True if it did."""
    from forge_rl.launch.slurm import job_end_time

    end = job_end_time(job_id) if margin_s > 0 else None
    if end is None:
        return False
    await asyncio.sleep(max(0.0, end - margin_s - time.time()))
    print(
        f"Slurm job {job_id} ends in {end - time.time():.0f} s (its time limit): stopping with a final checkpoint "
        "(launcher.slurm.stop_before_end_s)",
        flush=True,
    )
    os.kill(os.getpid(), signal.SIGINT)
    return True


async def weight_server(store_cfg):
    """The actor on the trainer's first host that hands published weights versions to generators on other hosts
    (Monarch RDMA, forge_rl/weights/rdma.py); pass it to the generators as `weight_source`."""
    from forge_rl.runtime.provisioner import get_provisioner
    from forge_rl.weights.rdma import WeightServer

    mesh = await get_provisioner().get_proc_mesh(mesh_name="WeightServer", host_mesh="trainer", host_index=0)
    return mesh.spawn("weight_server", WeightServer, None, store_cfg)


# Monarch's batch mode caches the job here (relative to the directory sbatch ran in), for the app to reattach.
BATCH_STATE_FILE = ".monarch/job_state.pkl"


def submit(recipe: str, config: str | None, overrides: list[str], launcher: LauncherConfig, output_dir: str) -> str:
    """Submit one sbatch job that runs the workers and `python -m forge_rl.recipes <recipe>` inside the allocation;
    its job id."""
    from forge_rl.deps.monarch import slurm_job_id

    job = slurm_job(launcher.slurm, Path(output_dir) / "slurm")
    python = launcher.slurm.python or sys.executable
    argv = [
        python,
        "-m",
        "forge_rl.recipes",
        recipe,
        *(["--config", config] if config else []),
        *overrides,
        "launcher.kind=slurm",
    ]
    job.apply(client_script=shlex.join(argv))
    return slurm_job_id(job)


def main(argv: list[str] | None = None) -> None:
    """python -m forge_rl.launch.launcher submit [--recipe grpo] --config FILE [key=value ...]"""
    from forge_rl.recipes import RECIPES, recipe

    parser = argparse.ArgumentParser(
        prog="python -m forge_rl.launch.launcher",
        description="Run an app on Slurm: workers and controller in one sbatch job.",
    )
    parser.add_argument("command", choices=["submit"])
    parser.add_argument("--recipe", default="grpo", choices=RECIPES, help="the run to submit (default grpo)")
    parser.add_argument("--config", help="YAML config file")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. launcher.slurm.partition=gpu")
    args = parser.parse_intermixed_args(argv)  # options before, between or after the key=value overrides
    from forge_rl.config import load_config
    from forge_rl.errors import ConfigError, one_line

    schema = recipe(args.recipe).CONFIG
    try:
        cfg = load_config(schema, args.config, [*args.overrides, "launcher.kind=slurm"])
    except ConfigError as e:
        parser.exit(2, f"forge_rl: {one_line(e)}\n")
    job_id = submit(args.recipe, args.config, args.overrides, cfg.launcher, cfg.output_dir)
    print(
        f"submitted Slurm job {job_id}: workers on {cfg.launcher.slurm.trainer_nodes} trainer + "
        f"{cfg.launcher.slurm.generator_nodes} generator nodes; the app's output: "
        f"{Path(cfg.output_dir) / 'slurm'}/slurm_{job_id}_*.out"
    )


if __name__ == "__main__":
    main()
