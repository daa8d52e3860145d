"""GRPO on a real Slurm cluster: slurmctld and three slurmd nodes, each a host of its own
(tests/support/slurm_cluster.py).

The trainer runs on its own node(s) (FSDP across two of them in one test) and the generator on another, so every
weights version crosses hosts through the weight store's RDMA path. Three ways in, as a user would run them: the
interactive controller on the login host
(sbatch of the workers, attach, reattach to a kept allocation, cancel at exit), one sbatch job running workers
and controller inside the allocation, and a requeue in the middle of such a job (what preemption does), after
which the job resumes from its last checkpoint and each node has swept what the killed job left in its /dev/shm.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from forge_rl.loop.checkpoint import complete_checkpoints
from tests.support.slurm_cluster import SlurmCluster, missing

REPO = Path(__file__).resolve().parents[2]  # tests/integration/ -> the repository
CONFIG = str(REPO / "configs/grpo/tiny.yaml")
# small and quick: the point is where things run, not what is learnt
QUICK = ["eval_size=20", "eval_every=0", "batch_groups=4", "rollout_tasks=2", "verbose=false"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    why = missing()
    if why:
        if os.environ.get("FORGE_RL_REQUIRE_SLURM"):  # CI installs Slurm: there, a skip would hide a failure
            pytest.fail(f"FORGE_RL_REQUIRE_SLURM is set but {why}")
        pytest.skip(why)
    c = SlurmCluster(tmp_path_factory.mktemp("slurm"), nodes=3).start()
    yield c
    c.stop()


def _on_login(cluster: SlurmCluster, argv: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    env = cluster.env(PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    return subprocess.run(
        cluster.on_login(argv),
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def _squeue(cluster: SlurmCluster) -> list[str]:
    out = subprocess.run(
        ["squeue", "--noheader", "--format", "%i %T"], capture_output=True, text=True, env=cluster.env(), check=True
    )
    return out.stdout.split("\n")[:-1]


def _wait_gone(cluster: SlurmCluster, job_id: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(line.split()[0] == job_id for line in _squeue(cluster)):
            return
        time.sleep(1)
    raise AssertionError(f"Slurm job {job_id} still queued after {timeout_s} s: {_squeue(cluster)}")


def test_squeue_is_read_per_job_whatever_else_is_queued(cluster):
    from forge_rl.launch.slurm import expand_hostlist, squeue_job

    env = cluster.env()
    ids = []
    for nodes in (1, 2):  # two jobs: Slurm 22.05's `squeue --json --job X` lists both, and SlurmJob took the first
        out = subprocess.run(
            ["sbatch", "--parsable", f"--nodes={nodes}", "--output=/dev/null", "--wrap", "sleep 120"],
            capture_output=True,
            text=True,
            env=env,
            check=True,
        )
        ids.append(out.stdout.strip().split(";")[0])
    os.environ["SLURM_CONF"] = str(cluster.conf)
    try:
        deadline = time.monotonic() + 30
        while (found := squeue_job(ids[1])) and found[0] != "RUNNING" and time.monotonic() < deadline:
            time.sleep(0.5)
        assert found[0] == "RUNNING", found
        assert len(found[1]) == 2 and set(found[1]) <= set(cluster.nodes), found  # this job's two nodes, expanded
        assert squeue_job(ids[0])[0] in ("RUNNING", "PENDING")
        assert expand_hostlist("n[1-2]") == ["n1", "n2"]
        subprocess.run(["scancel", *ids], env=env, check=True)
        for job_id in ids:
            _wait_gone(cluster, job_id, 60)
            assert squeue_job(job_id) is None
    finally:
        del os.environ["SLURM_CONF"]


def test_grpo_interactive_on_three_nodes_stops_before_the_time_limit_then_reattaches(cluster, tmp_path):
    """Controller on the login host; two trainer ranks on two nodes (FSDP across hosts), the generator on the
    third. The first run, in a 5-minute allocation with stop_before_end_s=180, stops by itself 120 s into the job
    (time for the actors to start on the three nodes and train a step or more on a loaded 2-core machine) with a
    final checkpoint and keeps the allocation; a second run with the same settings reattaches to it (no
    new job), resumes from that checkpoint, finishes, and cancels the job at exit."""
    out = tmp_path / "run"
    argv = [
        sys.executable,
        "-m",
        "apps.grpo.main",
        "--config",
        CONFIG,
        "launcher.kind=slurm",
        f"output_dir={out}",
        "launcher.slurm.trainer_nodes=2",
        "trainer_procs=2",
        "launcher.slurm.time=00:05:00",
        *QUICK,
    ]
    first = _on_login(
        cluster,
        [*argv, "steps=100000", "launcher.slurm.keep_job=true", "launcher.slurm.stop_before_end_s=180"],
        tmp_path,
        300,
    )
    assert first.returncode == 130, first.stdout[-3000:] + first.stderr[-3000:]  # interrupted, by design
    assert "(its time limit): stopping with a final checkpoint" in first.stdout
    saved = complete_checkpoints(out / "checkpoints")
    assert saved, "stopped before its first step: " + first.stdout[-3000:]
    stopped_at = int(saved[-1].name.split("-")[1])
    assert stopped_at >= 1
    jobs = _squeue(cluster)
    assert len(jobs) == 1 and jobs[0].endswith("RUNNING"), jobs  # kept
    job_id = jobs[0].split()[0]
    second = _on_login(
        cluster, [*argv, f"steps={stopped_at + 2}", "resume=true", "launcher.slurm.stop_before_end_s=0"], tmp_path, 300
    )
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "Submitting SLURM job" not in second.stderr + second.stdout  # reattached to the kept allocation
    assert f"resumed from {out / 'checkpoints'}/step-{stopped_at}" in second.stdout
    _wait_gone(cluster, job_id, 60)  # cancelled at exit
    summary = json.loads((out / "summary.json").read_text())
    assert summary["trainer_version"] == stopped_at + 2 and summary["generator_versions"] == [stopped_at + 2]
    # the generator's host is not the trainer's: every version of this run came over RDMA
    assert summary["generator_stats"]["weights_fetched_from_other_host"] >= 2
    assert "trainer on 2 node(s), generators on 1 node(s)" in summary["placement"]


def test_grpo_sbatch_job_is_requeued_and_resumes(cluster, tmp_path):
    """One sbatch job runs the workers and the app. Its generator node's processes are SIGKILLed (a node lost to a
    preemption: nothing on it cleans up) and the job is requeued mid-run, on the same two nodes. It starts again,
    the app resumes from its last checkpoint (resume=auto) and finishes; the killed node's /dev/shm (a node's own:
    tests/support/slurm_cluster.py) held the dead run's weights until the requeued job's first process there opened its
    store, and after that only the live run's versions; at exit, the run's entries are gone from every node."""
    out = tmp_path / "run"
    # 6 steps: the kill comes at the first checkpoint (step 2), and the steps after it leave the killed job time to
    # be requeued before it could have finished; the requeued job then trains the rest
    nodes = cluster.nodes[:2]  # and not the third: the requeued job must come back to the node we look at
    submit = _on_login(
        cluster,
        [
            sys.executable,
            "-m",
            "forge_rl.launch.launcher",
            "submit",
            "--config",
            CONFIG,
            f"output_dir={out}",
            "steps=6",
            "checkpoint_every=2",
            "resume=auto",
            f"launcher.slurm.sbatch_args=[--requeue,--exclude={cluster.nodes[2]}]",
            *QUICK,
        ],
        tmp_path,
        60,
    )
    assert submit.returncode == 0, submit.stdout + submit.stderr
    job_id = submit.stdout.split("submitted Slurm job ")[1].split(":")[0]
    deadline = time.monotonic() + 300
    while not complete_checkpoints(out / "checkpoints") and time.monotonic() < deadline:
        time.sleep(1)
    assert complete_checkpoints(out / "checkpoints"), f"no checkpoint within 300 s: {_slurm_out(out, job_id)}"
    worker = _node_without_the_app(cluster, nodes)
    (dead,) = _wait_for(lambda: _runs_with_versions(cluster, worker), 60, f"no weights version in {worker}'s /dev/shm")
    _kill_jobs_processes(cluster, worker)
    subprocess.run(["scontrol", "requeue", job_id], env=cluster.env(), check=True)
    assert dead in _shm_runs(cluster, worker)  # left behind: nothing on the node survived to remove it

    def requeued_run_has_versions():
        return [run for run in _runs_with_versions(cluster, worker) if run != dead]

    (live,) = _wait_for(requeued_run_has_versions, 300, f"the requeued run published nothing to {worker}")
    runs = _shm_runs(cluster, worker)
    assert set(runs) == {live}, runs  # the dead run's versions and process registry: swept by the node itself
    assert len(_versions(cluster, worker, live)) <= 2, runs  # keep_versions
    # The killed job's app did not outlive its allocation: Slurm's requeue killed its batch runner, and the app
    # went with it instead of running on (reparented, out of proctrack/linuxproc's sight) beside the new one.
    (app_node,) = set(nodes) - {worker}
    assert len(_apps(cluster, app_node)) == 1, _apps(cluster, app_node)
    assert set(_shm_runs(cluster, app_node)) == {live}, _shm_runs(cluster, app_node)
    _wait_gone(cluster, job_id, 400)
    text = _slurm_out(out, job_id)
    assert "resumed from" in text and "done" in text, text[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["trainer_version"] == 6 and summary["start_step"] >= 2, summary
    assert summary["generator_versions"] == [6]
    assert {node: _shm_runs(cluster, node) for node in nodes} == {node: {} for node in nodes}  # cleaned at exit


def _shm_runs(cluster: SlurmCluster, node: str) -> dict[str, list[str]]:
    """The forge_rl entries in `node`'s /dev/shm by run id (forge_rl-<run>-weights-<host>, forge_rl-<run>-pids)."""
    runs: dict[str, list[str]] = {}
    for name in sorted(os.listdir(cluster.shm(node))):
        if name.startswith("forge_rl-"):
            runs.setdefault(name.split("-")[1], []).append(name)
    return runs


def _versions(cluster: SlurmCluster, node: str, run: str) -> list[str]:
    found = []
    for d in cluster.shm(node).glob(f"forge_rl-{run}-weights-*"):
        found += [v for v in os.listdir(d) if v.startswith("v") and v[1:].isdigit()]  # complete versions only
    return found


def _runs_with_versions(cluster: SlurmCluster, node: str) -> list[str]:
    return [run for run in _shm_runs(cluster, node) if _versions(cluster, node, run)]


def _wait_for(found, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not (got := found()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert got, f"{what} within {timeout_s} s"
    return got


def _node_processes(cluster: SlurmCluster, node: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", cluster.netns(node)], capture_output=True, text=True, check=True)
    return [int(pid) for pid in out.stdout.split()]


def _apps(cluster: SlurmCluster, node: str) -> list[int]:
    """The app processes (python -m forge_rl.recipes ...) running on `node`."""

    def runs_the_app(pid: int) -> bool:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            return argv[1:3] == [b"-m", b"forge_rl.recipes"]  # not the batch runner, whose argument names it
        except OSError:
            return False

    return [pid for pid in _node_processes(cluster, node) if runs_the_app(pid)]


def _node_without_the_app(cluster: SlurmCluster, nodes: list[str]) -> str:
    """The job's node where only workers run (the app runs on the batch host)."""
    (worker,) = [n for n in nodes if not _apps(cluster, n)]
    return worker


def _kill_jobs_processes(cluster: SlurmCluster, node: str) -> None:
    """SIGKILL every process of the job on `node` (Slurm's own daemons live on, as on a preempted node)."""
    for pid in _node_processes(cluster, node):
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() not in ("slurmd", "slurmstepd"):
                os.kill(pid, signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass  # gone already


def _slurm_out(out: Path, job_id: str) -> str:
    return "".join(p.read_text(errors="replace") for p in sorted((out / "slurm").glob(f"slurm_{job_id}_*")))


def test_slurm_config_errors_name_the_key():
    """Without a cluster: sizes that an allocation cannot hold fail at start, before any job is queued."""
    from forge_rl.recipes.grpo_checks import check_config
    from forge_rl.recipes.grpo_config import GRPOConfig
    from forge_rl.config import ConfigError, load_config

    def check(*overrides):
        check_config(load_config(GRPOConfig, REPO / "configs/grpo/qwen3_32b.yaml", ["model=/models/q", *overrides]))

    check()  # 32 ranks on 4 nodes of 8 GPUs; 8 replicas x TP 4 on 4 nodes
    with pytest.raises(ConfigError, match="launcher.slurm.gpus_per_node=8"):
        check("generator.replicas=12")
    with pytest.raises(ConfigError, match="trainer_procs=30 must spread evenly over launcher.slurm.trainer_nodes=4"):
        check("trainer_procs=30", "trainer.parallel.tp=2", "trainer.parallel.dp_shard=15")
    with pytest.raises(ConfigError, match="launcher.slurm.sbatch_args: 'requeue' is not an sbatch option"):
        check("launcher.slurm.sbatch_args=[requeue]")
    with pytest.raises(ConfigError, match="launcher.kind='k8s'"):
        check("launcher.kind=k8s")
