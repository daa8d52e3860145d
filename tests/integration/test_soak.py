"""The soak benchmark's short version: the GRPO app started as a user starts it, one of two generator replicas
SIGKILLed mid-run (the run goes on on the other while the service respawns it with the current weights), and
afterwards every episode accounted for and nothing left behind (benchmarks/soak.py runs the long one)."""

from pathlib import Path

from benchmarks.soak import soak

SMALL = [
    "batch_groups=4",
    "group_size=4",
    "rollout_tasks=2",
    "eval_size=8",
    "buffer.capacity=8",
    "generator.sampling.max_tokens=6",
    "generator.replicas=2",
]


def test_a_short_soak_survives_a_replica_kill_and_leaves_nothing_behind(tmp_path: Path):
    # the kill at step 2 of 4: the run goes on on the other replica, and its end waits for the respawn (finish()
    # evaluates with every replica on the final weights), so no step after the kill is needed for that
    report = soak(steps=4, kill_every=2, out=tmp_path, overrides=SMALL, sample_s=0.5, timeout_s=900)
    assert report["returncode"] == 0, (tmp_path / "soak.log").read_text()[-3000:]
    assert report["steps"] == 4
    assert len(report["kills"]) == 1 and report["respawns"] >= 1
    assert report["generator_versions"] == [4, 4]  # the respawned replica ended on the final weights too
    assert report["accounted"]  # added == trained + dropped (stale, zero advantage, ...) + still buffered
    assert report["rss_warm"] and report["rss_end"]  # every process of the run was sampled
    assert report["processes_seen"] > 5 and report["processes_left"] == []
    assert any(name.startswith("forge_rl-") for name in report["shm_seen"])  # the run's entries were seen...
    assert report["shm_left"] == []  # ... and none is left (other runs' entries are not looked at)
