"""Host meshes from a Slurm allocation: Monarch's SlurmJob, reading Slurm's state robustly.

Monarch's `SlurmJob` submits an sbatch job that starts one Monarch worker per node, waits for it to run and
attaches a host mesh per role (`job.state().trainer`). It reads the job with `squeue --json`, whose shape
changed across Slurm versions; measured on Debian's Slurm 22.05: the JSON lists every job in the queue (not
only the one asked for), `job_state` is a string and `job_resources.nodes` a hostlist string ("n[1-2]"), so
SlurmJob takes the first job in the queue for its own and finds no hosts. `SlurmHosts` reads the job with
squeue's plain format (`%T %N`, the same since Slurm 2.x) and expands the node list with `scontrol show
hostnames`; the rest is Monarch's.
"""

import subprocess
from typing import Any

from monarch.job import SlurmJob


def squeue_job(job_id: str) -> tuple[str, list[str]] | None:
    """(state, hostnames) of a job in the queue, or None when Slurm no longer lists it."""
    out = subprocess.run(["squeue", "--noheader", "--jobs", job_id, "--format", "%i|%T|%N"], capture_output=True,
                         text=True)
    if out.returncode != 0:  # "Invalid job id specified": finished and purged
        return None
    for line in out.stdout.splitlines():
        jid, _, rest = line.strip().partition("|")
        if jid == job_id:
            state, _, nodelist = rest.partition("|")
            return state, expand_hostlist(nodelist)
    return None


def expand_hostlist(nodelist: str) -> list[str]:
    """"n[1-2],gpu7" -> ["n1", "n2", "gpu7"] (by scontrol, which knows every form of Slurm's hostlists)."""
    nodelist = nodelist.strip()
    if not nodelist or nodelist == "(null)":
        return []
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
    return out.stdout.split()


class SlurmHosts(SlurmJob):
    """SlurmJob with a job reader that works across Slurm versions (see the module docstring)."""

    def _get_job_info_json(self, job_id: str) -> dict[str, Any] | None:
        found = squeue_job(job_id)
        if found is None:
            return None
        state, hosts = found
        # the shape SlurmJob reads (Slurm 23.02+ squeue --json)
        return {"job_state": [state], "job_resources": {"nodes": {"allocation": [{"name": h} for h in hosts]}}}
