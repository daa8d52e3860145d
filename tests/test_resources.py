"""Placement planning: derived budgets, explicit cores, and conflicting settings named by key."""

import pytest

from forge_rl.runtime.placement import ResourcesConfig, parse_cpus, plan_placement


def plan(cores, trainer_procs=1, replicas=1, **cfg):
    return plan_placement(ResourcesConfig(**cfg), trainer_procs, replicas, 0, cores=cores)


def test_auto_disaggregates_when_every_role_gets_a_core():
    p = plan([0, 1])
    assert p.mode == "disaggregated" and p.generator_cpus == [[0]] and p.trainer_cpus == [[1]]
    assert p.trainer_threads == 1


def test_auto_colocates_when_cores_are_too_few():
    p = plan([0, 1], trainer_procs=2)
    assert p.mode == "colocated" and p.generator_cpus == [[0, 1]] and p.trainer_cpus == [[0], [1]]


def test_colocated_time_shares_every_core():
    p = plan([0, 1], placement="colocated")
    assert p.generator_cpus == [[0, 1]] and p.trainer_cpus == [[0, 1]] and p.trainer_threads == 2
    assert "time-shared" in p.describe()


def test_derived_split_gives_each_replica_and_rank_its_own_cores():
    p = plan(list(range(8)), trainer_procs=2, replicas=2)
    assert p.generator_cpus == [[0, 1], [2, 3]] and p.trainer_cpus == [[4, 5], [6, 7]]
    assert not set(sum(p.generator_cpus, [])) & set(sum(p.trainer_cpus, []))


def test_explicit_cores_are_used_as_given():
    p = plan(list(range(8)), trainer_procs=2, replicas=2, generator_cpus="0-2|3-5", trainer_cpus="6,7", trainer_threads=1)
    assert p.generator_cpus == [[0, 1, 2], [3, 4, 5]] and p.trainer_cpus == [[6], [7]] and p.trainer_threads == 1


@pytest.mark.parametrize("cfg,trainer_procs,message", [
    (dict(placement="disaggregated"), 2, r"resources\.placement=disaggregated needs a core per generator replica"),
    (dict(generator_cpus="0", trainer_cpus="0", placement="disaggregated"), 1, r"share cores \[0\]"),
    (dict(generator_cpus="0|1"), 1, r"resources\.generator_cpus='0\|1' lists 2 replicas' cores; generator\.replicas=1"),
    (dict(trainer_cpus="7"), 1, r"resources\.trainer_cpus names cores \[7\]"),
    (dict(trainer_cpus="1-x"), 1, r"resources\.trainer_cpus='1-x': expected core ids"),
    (dict(placement="sideways"), 1, r"resources\.placement='sideways'"),
])
def test_conflicting_settings_name_their_keys(cfg, trainer_procs, message):
    with pytest.raises(ValueError, match=message):
        plan([0, 1], trainer_procs=trainer_procs, **cfg)


def test_gpus_disaggregate_when_enough_and_colocate_otherwise():
    assert plan_placement(ResourcesConfig(), 1, 1, 1, gpus=["0", "1"]).mode == "disaggregated"
    one = plan_placement(ResourcesConfig(), 1, 1, 1, gpus=["0"])
    assert one.mode == "colocated" and "sleeps" in one.describe()
    with pytest.raises(ValueError, match="needs 3 GPUs"):
        plan_placement(ResourcesConfig(placement="disaggregated"), 2, 1, 1, gpus=["0", "1"])


def test_parse_cpus():
    assert parse_cpus("0-3,6", "k") == [0, 1, 2, 3, 6]
    with pytest.raises(ValueError, match="distinct"):
        parse_cpus("1,1", "k")
