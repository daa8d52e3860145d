"""A GRPO run on the tiny mixture-of-experts model with an expert-parallel trainer: the trainer's logprobs are the
generator's (synchronous, fp32, T=1) before and after the EP ranks publish new weights. In a file of its own: the run
starts its own provisioner, which a module-scoped one (tests/integration/test_moe.py's trainers) would refuse."""

import asyncio

from forge_rl.config import load_config
from tests.conftest import REPO


def test_sync_fp32_grpo_with_an_ep_trainer_matches_the_generators_logprobs(tmp_path):
    """The trainer (EP 2) scores the tokens vLLM sampled, at T=1, synchronous, fp32 on both sides: the generator's
    logprobs agree to < 1e-4 at step 1 (the shipped weights) and at step 2 (weights the EP ranks published and vLLM
    reloaded: its CPU MoE layers are prepacked again after the reload, forge_rl/deps/vllm.py).

    With Keep Routing (trainer.keep_routing): every position the engine ran reaches the trainer's expert layers with
    the experts the engine chose, on both EP ranks, at every step (with the load-balancing loss on), and the reference
    (the KL's) replays them too."""
    from forge_rl.observability.metrics import read_jsonl
    from forge_rl.recipes.grpo import GRPOConfig, main
    from tests.integration.test_mismatch import SYNC_SMALL

    cfg = load_config(
        GRPOConfig,
        REPO / "configs/grpo/tiny.yaml",
        SYNC_SMALL
        + [
            f"output_dir={tmp_path}",
            "model=tiny-moe",
            "trainer_procs=2",
            "trainer.parallel.ep=2",
            "trainer.keep_routing=true",
            "trainer.loss.kl_coef=0.01",
            "trainer.moe_aux_loss_coef=0.001",
        ],
    )
    asyncio.run(main(cfg))
    steps = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "trainer/loss" in r]
    assert len(steps) == 2
    for r in steps:
        assert r["trainer/mismatch_abs_mean"] < 1e-4 and r["trainer/mismatch_abs_max"] < 1e-3, r
        assert r["trainer/grad_norm"] > 0
        # every response token's experts (and its context's) were the engine's: 2 groups x 4 x (>= 4 prompt + 1
        # response positions) x 4 layers at the least
        assert r["trainer/keep_routing/replayed"] >= 2 * 4 * 5 * 4, r
        assert r["trainer/keep_routing/dispatched_equal_fraction"] == 1.0, r
        assert r["generator/routes_bytes_per_token"] == 4 * 2  # 4 layers x top 2, one byte an id
    assert steps[1]["trainer/kl_ref"] > 0  # the reference scored the batch (through the same experts)
