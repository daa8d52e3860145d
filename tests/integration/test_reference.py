"""A reference that follows the policy: it loads an earlier version from the weight store and scores with it."""

import torch

from forge_rl.actors.reference import Reference
from forge_rl.weights import ShmWeightStore, WeightStoreConfig
from tests.integration.test_trainer import config, make_batch, spawn, steps


def test_reference_follows_the_policy_to_an_earlier_version_from_the_weight_store(loop, tmp_path):
    """The trainer steps twice, publishing versions 1 and 2; the reference, built from the shipped model, scores as
    the shipped model until it follows version 1, then exactly as the trainer did at version 1 (fp32 publish); over
    kept sets (truncated sampling) too, as the trainer renormalises, so a KL to it is over the same sets."""
    from dataclasses import replace

    from forge_rl.runtime import stop_actor

    probe = make_batch(7)
    sets = torch.stack([probe.tokens, (probe.tokens + 1) % 128, (probe.tokens + 5) % 128], -1).int()
    truncated = replace(probe, kept=sets.where(probe.response_mask[..., None], -1))  # each token and two others
    store_cfg = WeightStoreConfig(keep_versions=2)
    store = ShmWeightStore(cfg=store_cfg)  # the test's reader: the run's store, for cleanup
    try:
        trainer = spawn(loop, config(tmp_path))
        shipped = loop.run_until_complete(trainer.logprobs.call_one(probe))
        steps(loop, trainer, 1, seeds=(0,))
        loop.run_until_complete(trainer.push_weights.call_one(1))
        at_version_1 = loop.run_until_complete(trainer.logprobs.call_one(probe))
        at_version_1_kept = loop.run_until_complete(trainer.logprobs.call_one(truncated))
        steps(loop, trainer, 1, seeds=(1,))
        loop.run_until_complete(trainer.push_weights.call_one(2))

        reference = loop.run_until_complete(
            Reference.options(procs=1, spmd=True).as_actor(config(tmp_path / "ref"), store_cfg)
        )
        mask = probe.response_mask

        def scored(batch=probe) -> torch.Tensor:
            [filled] = loop.run_until_complete(reference.fill_ref_logprobs.call_one([batch]))
            return filled.ref_logprobs

        assert loop.run_until_complete(reference.version.call_one()) == 0
        assert torch.equal(scored(), shipped.where(mask, 0.0))
        assert loop.run_until_complete(reference.follow.call_one(1)) == 1
        assert loop.run_until_complete(reference.version.call_one()) == 1
        followed = scored()
        assert (followed - at_version_1.where(mask, 0.0)).abs().max() < 1e-6
        assert (followed - shipped.where(mask, 0.0)).abs().max() > 1e-4  # it moved: not the shipped model's
        over_sets = scored(truncated)
        assert (over_sets - at_version_1_kept.where(mask, 0.0)).abs().max() < 1e-6
        assert (over_sets - followed)[mask].min() > 1e-2  # renormalised over 3 ids: far above the whole vocabulary's
        for actor in (reference, trainer):
            loop.run_until_complete(stop_actor(actor))
    finally:
        store.close()
