"""GPU placement: the plan names each trainer rank's GPU and each generator replica's GPUs (distinct per replica),
and the provisioner pins exactly those (CUDA_VISIBLE_DEVICES of each proc). All on simulated GPU lists."""

from pathlib import Path

import pytest

from forge_rl.runtime import provisioned
from forge_rl.runtime.placement import ResourcesConfig, plan_placement
from forge_rl.runtime.provisioner import Provisioner, _bootstrap
from tests.support.actors import DistributedProbe
from tests.conftest import run

EIGHT = [str(i) for i in range(8)]


def plan8(placement, trainer_procs, replicas, tp, gpus=EIGHT):
    return plan_placement(ResourcesConfig(placement=placement), trainer_procs, replicas, tp, gpus=gpus)


def _distinct(generator_gpus):
    flat = [g for ids in generator_gpus for g in ids]
    return len(flat) == len(set(flat))


def test_colocated_spreads_replicas_over_every_gpu_and_time_shares_them_with_the_trainer():
    p = plan8("colocated", trainer_procs=8, replicas=4, tp=2)
    assert p.mode == "colocated" and p.device == "cuda"
    assert p.generator_gpus == [["0", "1"], ["2", "3"], ["4", "5"], ["6", "7"]] and _distinct(p.generator_gpus)
    assert p.trainer_gpus == EIGHT
    assert (
        "generator replicas [0,1 | 2,3 | 4,5 | 6,7]" in p.describe()
        and "trainer ranks on GPUs [0,1,2,3,4,5,6,7]" in p.describe()
    )
    # auto on a 4-GPU node with configs/grpo/qwen3_1_7b.yaml's sizes: colocated, one replica per GPU
    p = plan8("auto", trainer_procs=4, replicas=4, tp=1, gpus=EIGHT[:4])
    assert p.mode == "colocated" and p.generator_gpus == [["0"], ["1"], ["2"], ["3"]] and p.trainer_gpus == EIGHT[:4]
    # fewer replicas than GPUs: spread, not stacked on the first ones
    assert plan8("colocated", 4, 2, 1, gpus=EIGHT[:4]).generator_gpus == [["0"], ["2"]]


def test_disaggregated_gives_trainer_and_replicas_disjoint_gpus():
    p = plan8("disaggregated", trainer_procs=4, replicas=2, tp=2)
    assert p.trainer_gpus == ["0", "1", "2", "3"] and p.generator_gpus == [["4", "5"], ["6", "7"]]
    assert not set(p.trainer_gpus) & {g for ids in p.generator_gpus for g in ids}
    assert plan8("auto", 4, 2, 2).mode == "disaggregated"
    p = plan8("disaggregated", trainer_procs=2, replicas=2, tp=2)  # 2 spare GPUs: replicas spread over the rest
    assert p.trainer_gpus == ["0", "1"] and p.generator_gpus == [["2", "3"], ["5", "6"]] and _distinct(p.generator_gpus)


@pytest.mark.parametrize(
    "placement,trainer_procs,replicas,tp,message",
    [
        (
            "colocated",
            8,
            5,
            2,
            r"generator\.replicas=5 x generator\.engine_args\.tensor_parallel_size=2 must each be at most 8",
        ),
        ("colocated", 9, 1, 1, r"trainer_procs=9 .* at most 8"),
        (
            "disaggregated",
            4,
            3,
            2,
            r"resources\.placement=disaggregated needs 10 GPUs \(trainer_procs=4 \+ generator\.replicas=3",
        ),
        ("auto", 4, 5, 2, r"generator\.replicas=5 x generator\.engine_args\.tensor_parallel_size=2"),
        ("colocated", 1, 1, 0, r"generator\.engine_args\.tensor_parallel_size=0"),
    ],
)
def test_what_does_not_fit_is_refused_naming_the_keys(placement, trainer_procs, replicas, tp, message):
    with pytest.raises(ValueError, match=message):
        plan8(placement, trainer_procs, replicas, tp)


def _env_of_procs(monkeypatch, mesh_gpu_ids: list[str], procs: int, gpus: int) -> list[str]:
    """CUDA_VISIBLE_DEVICES that the proc bootstrap sets in each of a mesh's procs, run in this process."""
    import monarch.actor

    comm = Path(f"/proc/self/task/{__import__('os').getpid()}/comm")
    name = comm.read_text().strip()
    seen = []
    for rank in range(procs):
        monkeypatch.setattr(monarch.actor, "current_rank", lambda rank=rank: type("R", (), {"rank": rank})())
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(EIGHT))
        monkeypatch.setenv("FORGE_RL_RUN_ID", "test")
        _bootstrap("probe", procs, procs, mesh_gpu_ids, gpus, [], 0, None, "test")()
        seen.append(__import__("os").environ["CUDA_VISIBLE_DEVICES"])
    comm.write_text(name)
    return seen


@pytest.mark.parametrize("placement,trainer_procs,replicas,tp", [("colocated", 8, 4, 2), ("disaggregated", 4, 2, 2)])
def test_the_provisioners_proc_env_is_the_plans_gpus(monkeypatch, placement, trainer_procs, replicas, tp):
    plan = plan8(placement, trainer_procs, replicas, tp)
    prov = object.__new__(Provisioner)  # only its GPU bookkeeping: no procs, no reaper
    prov._visible_gpus, prov._free_gpus = list(EIGHT), list(EIGHT)
    share = plan.colocated
    ids, _ = prov._take_gpus("Trainer", trainer_procs, 1, plan.trainer_gpus, share)
    assert _env_of_procs(monkeypatch, ids, trainer_procs, 1) == plan.trainer_gpus
    for r, want in enumerate(plan.generator_gpus):
        ids, _ = prov._take_gpus(f"Generator-r{r}", 1, tp, want, share)
        assert _env_of_procs(monkeypatch, ids, 1, tp) == [",".join(want)]
    if not share:  # disaggregated: each GPU reserved once
        assert prov._free_gpus == []
        with pytest.raises(RuntimeError, match=r"\['4', '5'\] are another mesh's"):
            prov._take_gpus("again", 1, tp, plan.generator_gpus[0], False)


def test_spawned_replicas_see_their_planned_gpus(monkeypatch):
    """Real procs: a colocated service of 4 replicas x 2 GPUs on a simulated 8-GPU node, and a trainer mesh of the
    disaggregated plan; each proc's CUDA_VISIBLE_DEVICES is what the plan says (the old provisioner gave every
    colocated replica the first GPUs)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(EIGHT))
    colocated = plan8("colocated", 8, 4, 2)
    disaggregated = plan8("disaggregated", 4, 2, 2)

    async def body():
        async with provisioned():
            service = await DistributedProbe.options(
                replicas=4, gpus=2, share_gpus=True, gpu_ids=tuple(map(tuple, colocated.generator_gpus))
            ).as_service()
            seen = [
                (await r.actor.env.call_one(["CUDA_VISIBLE_DEVICES"]))["CUDA_VISIBLE_DEVICES"]
                for r in service._replicas
            ]
            assert seen == ["0,1", "2,3", "4,5", "6,7"]
            trainer = await DistributedProbe.options(
                procs=4, gpus=1, gpu_ids=(tuple(disaggregated.trainer_gpus),)
            ).as_actor()
            by_rank = {
                point.rank: env["CUDA_VISIBLE_DEVICES"]
                for point, env in (await trainer.env.call(["CUDA_VISIBLE_DEVICES"])).items()
            }
            assert [by_rank[i] for i in range(4)] == disaggregated.trainer_gpus

    run(body())
