"""A reference that follows the policy: it loads an earlier version from the weight store and scores with it."""

import torch

from forge_rl.actors.reference import Reference
from forge_rl.weights import ShmWeightStore, WeightStoreConfig
from tests.test_trainer import config, make_batch, spawn, steps


def test_reference_follows_the_policy_to_an_earlier_version_from_the_weight_store(loop, tmp_path):
    """The trainer steps twice, publishing versions 1 and 2; the reference, built from the shipped model, scores as
    the shipped model until it follows version 1, then exactly as the trainer did at version 1 (fp32 publish)."""
    from forge_rl.runtime import stop_actor

    probe = make_batch(7)
    store_cfg = WeightStoreConfig(keep_versions=2)
    store = ShmWeightStore(cfg=store_cfg)  # the test's reader: the run's store, for cleanup
    try:
        trainer = spawn(loop, config(tmp_path))
        shipped = loop.run_until_complete(trainer.logprobs.call_one(probe))
        steps(loop, trainer, 1, seeds=(0,))
        loop.run_until_complete(trainer.push_weights.call_one(1))
        at_version_1 = loop.run_until_complete(trainer.logprobs.call_one(probe))
        steps(loop, trainer, 1, seeds=(1,))
        loop.run_until_complete(trainer.push_weights.call_one(2))

        reference = loop.run_until_complete(Reference.options(procs=1, spmd=True).as_actor(config(tmp_path / "ref"),
                                                                                            store_cfg))
        mask = probe.response_mask

        def scored() -> torch.Tensor:
            [filled] = loop.run_until_complete(reference.fill_ref_logprobs.call_one([probe]))
            return filled.ref_logprobs

        assert loop.run_until_complete(reference.version.call_one()) == 0
        assert torch.equal(scored(), shipped.where(mask, 0.0))
        assert loop.run_until_complete(reference.follow.call_one(1)) == 1
        assert loop.run_until_complete(reference.version.call_one()) == 1
        followed = scored()
        assert (followed - at_version_1.where(mask, 0.0)).abs().max() < 1e-6
        assert (followed - shipped.where(mask, 0.0)).abs().max() > 1e-4  # it moved: not the shipped model's
        for actor in (reference, trainer):
            loop.run_until_complete(stop_actor(actor))
    finally:
        store.close()


def test_a_grpo_run_with_a_kl_to_a_moving_anchor_records_each_steps_reference_version(tmp_path):
    """reference.follow_every=1, follow_lag=1: step 1 and 2 are scored by the starting policy (version 0; after step
    1 the anchor would be version 0 again), step 3 by version 1, step 4 by version 2; the metrics say so."""
    import asyncio

    from forge_rl.config import load_config
    from forge_rl.recipes.grpo import main
    from forge_rl.recipes.grpo_config import GRPOConfig
    from tests.conftest import REPO
    from forge_rl.observability.metrics import read_jsonl
    from tests.test_grpo_app import SMALL

    cfg = load_config(GRPOConfig, REPO / "configs/grpo/tiny.yaml",
                      SMALL + ["steps=4", f"output_dir={tmp_path}", "trainer.grpo.kl_coef=0.1", "export_dir=null",
                               "reference.follow_every=1", "reference.follow_lag=1"])
    asyncio.run(main(cfg))
    rows = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "trainer/loss" in r]
    assert [r["reference/version"] for r in rows] == [0, 0, 1, 2]
    assert all(r["trainer/kl_ref"] >= 0 for r in rows)
