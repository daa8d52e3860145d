"""Placement planning: derived budgets, explicit cores, and conflicting settings named by key."""

import pytest

import forge_rl.runtime.placement as placement_module
from forge_rl.runtime.placement import CPUS_ENV, ResourcesConfig, parse_cpus, plan_placement


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


def test_derived_cores_follow_forge_rl_cpus_in_its_order(monkeypatch):
    """Two runs sharing four cores: listed in opposite orders, one's generator runs on the other's trainer cores."""
    monkeypatch.setattr(placement_module.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.delenv(CPUS_ENV, raising=False)
    first = plan_placement(ResourcesConfig(), 1, 1, 0)
    monkeypatch.setenv(CPUS_ENV, "2-3,0-1")
    second = plan_placement(ResourcesConfig(), 1, 1, 0)
    assert (first.generator_cpus, first.trainer_cpus) == ([[0, 1]], [[2, 3]])
    assert (second.generator_cpus, second.trainer_cpus) == ([[2, 3]], [[0, 1]])
    monkeypatch.setenv(CPUS_ENV, "3,4")
    with pytest.raises(ValueError, match=r"FORGE_RL_CPUS='3,4' names cores \[4\] that this process may not use"):
        plan_placement(ResourcesConfig(), 1, 1, 0)


def test_derived_split_gives_each_replica_and_rank_its_own_cores():
    p = plan(list(range(8)), trainer_procs=2, replicas=2)
    assert p.generator_cpus == [[0, 1], [2, 3]] and p.trainer_cpus == [[4, 5], [6, 7]]
    assert not set(sum(p.generator_cpus, [])) & set(sum(p.trainer_cpus, []))


def test_explicit_cores_are_used_as_given():
    p = plan(
        list(range(8)), trainer_procs=2, replicas=2, generator_cpus="0-2|3-5", trainer_cpus="6,7", trainer_threads=1
    )
    assert p.generator_cpus == [[0, 1, 2], [3, 4, 5]] and p.trainer_cpus == [[6], [7]] and p.trainer_threads == 1


@pytest.mark.parametrize(
    "cfg,trainer_procs,message",
    [
        (dict(placement="disaggregated"), 2, r"resources\.placement=disaggregated needs a core per generator replica"),
        (dict(generator_cpus="0", trainer_cpus="0", placement="disaggregated"), 1, r"share cores \[0\]"),
        (
            dict(generator_cpus="0|1"),
            1,
            r"resources\.generator_cpus='0\|1' lists 2 replicas' cores; generator\.replicas=1",
        ),
        (dict(trainer_cpus="7"), 1, r"resources\.trainer_cpus names cores \[7\]"),
        (dict(trainer_cpus="1-x"), 1, r"resources\.trainer_cpus='1-x': expected core ids"),
        (dict(placement="sideways"), 1, r"resources\.placement='sideways'"),
    ],
)
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


def test_reward_models_are_placed_like_a_role():
    from forge_rl.runtime.placement import plan_reward_models

    cpu = plan_reward_models(ResourcesConfig(reward_model_cpus="1|0-1"), plan([0, 1]), 2, cores=[0, 1])
    assert cpu.reward_model_cpus == [[1], [0, 1]] and "reward models on [cores 1 | cores 0,1]" in cpu.describe()
    assert plan_reward_models(ResourcesConfig(), plan([0, 1]), 1, cores=[0, 1]).reward_model_cpus == []  # unpinned
    gpus = plan_placement(ResourcesConfig(), 1, 1, 1, gpus=["0", "1", "2"])  # trainer 0, generator 1: 2 is free
    assert plan_reward_models(ResourcesConfig(), gpus, 2).reward_model_gpus == [["2"], ["2"]]
    full = plan_placement(ResourcesConfig(), 1, 1, 1, gpus=["0", "1"])  # none free: the last one, time-shared
    assert plan_reward_models(ResourcesConfig(), full, 1).reward_model_gpus == [["1"]]
    assert plan_reward_models(ResourcesConfig(reward_model_gpus="0"), full, 1).reward_model_gpus == [["0"]]
    for cfg, placement, message in [
        (dict(reward_model_cpus="1"), plan([0, 1]), "lists 1 reward models' devices; rewards has 2"),
        (dict(reward_model_cpus="5|1"), plan([0, 1]), r"reward_model_cpus names cores \[5\]"),
        (dict(reward_model_gpus="7|1"), full, r"names GPUs \['7'\]"),
        (dict(reward_model_gpus="0|0"), plan([0, 1]), "this host has none visible"),
    ]:
        with pytest.raises(ValueError, match=message):
            plan_reward_models(ResourcesConfig(**cfg), placement, 2, cores=[0, 1])
