"""What the service reports of itself: its process tree's count and memory, and where its generator and trainers
run on a CPU machine."""

import os

from forge_rl.runtime.placement import ResourcesConfig
from forge_rl.tinker.config import TinkerConfig
from forge_rl.tinker.service import cpu_options
from forge_rl.tinker.usage import process_usage


def test_process_usage_adds_up_this_process_tree():
    usage = process_usage()  # the service's children are counted in tests/integration/test_tinker.py
    assert usage["processes"] >= 1
    assert sum(e["processes"] for e in usage["by_name"].values()) == usage["processes"]
    assert abs(sum(e["uss_mib"] for e in usage["by_name"].values()) - usage["uss_mib"]) < 0.1 * usage["processes"]
    assert 0 < usage["uss_mib"] <= usage["rss_mib"]


def test_generator_and_trainers_get_cores_of_their_own_where_there_are_enough():
    cores = sorted(os.sched_getaffinity(0))
    generator, trainer = cpu_options(TinkerConfig())
    if len(cores) < 2:  # one core: the roles share it, nothing pinned
        assert generator == trainer == {}
        return
    (mine,) = generator["cpus"]
    assert mine and trainer["cpus"] and not set(mine) & {c for t in trainer["cpus"] for c in t}
    assert trainer["threads"] == len(trainer["cpus"][0])
    shared = cpu_options(TinkerConfig(resources=ResourcesConfig(placement="colocated")))
    assert shared == ({}, {})
