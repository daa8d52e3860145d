"""Host meshes from a Slurm allocation: Monarch's SlurmJob, reading Slurm's state robustly.

Monarch's `SlurmJob` submits an sbatch job that starts one Monarch worker per node, waits for it to run and
attaches a host mesh per role (`job.state().trainer`). It reads the job with `squeue --json`, whose shape
changed across Slurm versions; in Slurm 22.05 (Debian's), the JSON lists every job in the queue (not
only the one asked for), `job_state` is a string and `job_resources.nodes` a hostlist string ("n[1-2]"), so
SlurmJob takes the first job in the queue for its own and finds no hosts. `SlurmHosts` reads the job with
squeue's plain format (`%T %N`, the same since Slurm 2.x) and expands the node list with `scontrol show
hostnames`; the rest is Monarch's.
"""

import subprocess
import time
from datetime import datetime
from typing import Any

from monarch.job import SlurmJob


def squeue_job(job_id: str) -> tuple[str, list[str]] | None:
    """(state, hostnames) of a job in the queue, or None when Slurm no longer lists it."""
    out = subprocess.run(
        ["squeue", "--noheader", "--jobs", job_id, "--format", "%i|%T|%N"], capture_output=True, text=True
    )
    if out.returncode != 0:  # "Invalid job id specified": finished and purged
        return None
    for line in out.stdout.splitlines():
        jid, _, rest = line.strip().partition("|")
        if jid == job_id:
            state, _, nodelist = rest.partition("|")
            return state, expand_hostlist(nodelist)
    return None


def expand_hostlist(nodelist: str) -> list[str]:
    """ "n[1-2],gpu7" -> ["n1", "n2", "gpu7"] (by scontrol, which knows every form of Slurm's hostlists)."""
    nodelist = nodelist.strip()
    if not nodelist or nodelist == "(null)":
        return []
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
    return out.stdout.split()


def job_end_time(job_id: str) -> float | None:
    """When Slurm will end the job (its time limit), as a Unix time; None without a limit or when not running."""
    out = subprocess.run(
        ["squeue", "--noheader", "--jobs", job_id, "--format", "%i|%T|%e"], capture_output=True, text=True
    )
    for line in out.stdout.splitlines() if out.returncode == 0 else []:
        jid, state, end = line.strip().split("|")
        if jid == job_id and state == "RUNNING":
            try:  # squeue prints the controller's local time, e.g. 2026-11-24T09:10:00
                return time.mktime(datetime.strptime(end, "%Y-%m-%dT%H:%M:%S").timetuple())
            except ValueError:  # "N/A", "Unknown": no limit
                return None
    return None


class SlurmHosts(SlurmJob):
    """SlurmJob with a job reader that works across Slurm versions (see the module docstring). The method it
    overrides is private to Monarch (forge_rl.deps.monarch.SLURM_JOB_READER; tests/unit/deps/test_deps.py checks it)."""

    def _get_job_info_json(self, job_id: str) -> dict[str, Any] | None:
        found = squeue_job(job_id)
        if found is None:
            return None
        state, hosts = found
        # the shape SlurmJob reads (Slurm 23.02+ squeue --json)
        return {"job_state": [state], "job_resources": {"nodes": {"allocation": [{"name": h} for h in hosts]}}}
