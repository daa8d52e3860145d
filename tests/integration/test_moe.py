"""Mixture of experts end to end on the embedded tiny-moe (Qwen3-MoE, 4 experts, top 2): the shipped checkpoint
rebuilds bit for bit and is the same model in transformers and TorchTitan; expert-parallel trainer ranks match one
proc and publish the experts in vLLM's per-expert layout, each rank its own experts; a synchronous fp32 GRPO run with
an EP trainer sees the generator's logprobs to < 1e-4 after every publish (tests/integration/test_moe_grpo.py: its
runs start
their own provisioner); LoRA on MoE is refused by name."""

import pytest
import torch
from safetensors.torch import load_file

from forge_rl.actors.trainer import Trainer
from forge_rl.actors.trainer_config import OptimizerConfig, ParallelConfig, TrainerConfig
from forge_rl.config import ConfigError, load_config
from forge_rl.models import resolve_model_path
from tests.conftest import REPO
from tests.integration.test_trainer import make_batch, split

TINY_MOE = resolve_model_path("tiny-moe")


def test_build_reproduces_the_shipped_files_and_titan_matches_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    from forge_rl.models.build_tiny_moe import build
    from forge_rl.models.qwen3 import build_model

    build(tmp_path)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / name).read_bytes() == (REPO / "forge_rl/models/tiny_moe" / name).read_bytes(), name
    rebuilt, shipped = load_file(tmp_path / "model.safetensors"), load_file(f"{TINY_MOE}/model.safetensors")
    assert rebuilt.keys() == shipped.keys() and all(torch.equal(rebuilt[k], shipped[k]) for k in shipped)
    assert "model.layers.3.mlp.experts.3.down_proj.weight" in shipped  # vLLM's per-expert layout
    titan, _ = build_model(TINY_MOE)
    hf = AutoModelForCausalLM.from_pretrained(TINY_MOE, dtype=torch.float32).eval()
    assert sum(p.numel() for p in titan.parameters()) == sum(p.numel() for p in hf.parameters())
    tokens = torch.randint(3, 99, (3, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (titan(tokens) - hf(tokens).logits).abs().max().item() < 1e-4


def test_a_bf16_autocast_forward_of_one_rank_runs_and_stays_near_fp32():
    """A bf16 trainer on one rank (no FSDP policy: torch.autocast) runs the experts' matmuls in bf16 on fp32 tokens:
    their outputs come back in the tokens' dtype, which the combine adds them into (it raised a dtype error)."""
    from forge_rl.models.qwen3 import build_model

    model, _ = build_model(TINY_MOE)
    tokens = torch.randint(3, 99, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        fp32 = model(tokens)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            bf16 = model(tokens).float()
    assert (bf16 - fp32).abs().max().item() < 0.5 and (bf16 - fp32).abs().mean().item() < 0.05


def test_load_balancing_loss_by_hand_and_its_gradient_reaches_every_router():
    from forge_rl.models.moe_aux import RouterStats, balancing_loss
    from forge_rl.models.qwen3 import build_model

    scores = torch.tensor([[[0.7, 0.1, 0.1, 0.1], [0.1, 0.7, 0.1, 0.1]]])
    ids = torch.tensor([[[0, 1], [1, 0]]])  # f = [1, 1, 0, 0] (K = 2 choices a token), P = [.4, .4, .1, .1]
    assert balancing_loss([(scores, ids)]).item() == pytest.approx(3.2)  # 4 x (.4 + .4)
    even = torch.full((1, 4, 4), 0.25), torch.tensor([[[0, 1], [2, 3], [0, 1], [2, 3]]])
    assert balancing_loss([even] * 3).item() == pytest.approx(2.0)  # K for even routing, whatever the layers
    model, _ = build_model(TINY_MOE)
    stats = RouterStats(model)
    tokens = torch.randint(3, 99, (2, 16), generator=torch.Generator().manual_seed(0))
    model.eval()
    with torch.no_grad():
        model(tokens)
    assert stats.records == []  # evaluation forwards add nothing
    model.train()
    model(tokens)
    assert len(stats.records) == 4  # one per MoE layer
    aux = stats.pop_loss()
    assert 2.0 <= aux.item() < 3.0 and stats.records == []  # near K = 2 for near-even routing (at most E = 4)
    aux.backward()
    grads = [m.moe.router.gate.weight.grad for m in model.layers.values()]
    assert all(g is not None and g.abs().sum() > 0 for g in grads)
    # the last layer's experts come after every router: the loss does not reach them
    assert model.layers["3"].moe.routed_experts.inner_experts.w1_EFD.grad is None


def test_load_balancing_loss_is_transformers_qwen3_moe_term_padding_masked():
    """The same router logits (3 layers, 2 right-padded rows) through transformers' own `load_balancing_loss_func`
    (Qwen3-MoE's `router_aux_loss_coef` term) and through ours: the same value, with and without the attention
    mask, and the padded tokens change neither. `unpadded` is that mask for a TrainBatch's response mask."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    from forge_rl.models.moe_aux import balancing_loss, unpadded

    B, T, E, K = 2, 6, 8, 2
    logits = torch.randn(3, B * T, E, generator=torch.Generator().manual_seed(0)) * 2
    response = torch.tensor([[0, 0, 1, 1, 1, 0], [0, 1, 1, 0, 0, 0]], dtype=torch.bool)
    mask = unpadded(response)
    assert mask.tolist() == [[True] * 5 + [False], [True] * 3 + [False] * 3]

    def ours(logits, token_mask=None):
        probs = logits.softmax(-1)
        return balancing_loss([(p.view(B, T, E), p.topk(K, -1).indices.view(B, T, K)) for p in probs], token_mask)

    for token_mask in (None, mask):
        theirs = load_balancing_loss_func(tuple(logits), E, K, token_mask.long() if token_mask is not None else None)
        assert ours(logits, token_mask).item() == pytest.approx(theirs.item(), rel=1e-6)
    padded_changed = logits.clone().view(3, B, T, E)
    padded_changed[:, ~mask] = torch.randn(3, int((~mask).sum()), E)
    assert ours(padded_changed.view(3, B * T, E), mask).item() == pytest.approx(ours(logits, mask).item(), rel=1e-6)
    assert ours(logits).item() != pytest.approx(ours(logits, mask).item(), rel=1e-6)  # the padding did count


def test_the_token_mask_of_prompt_packed_rows():
    from forge_rl.data.prompt_packing import plan_packing
    from forge_rl.models.moe_aux import unpadded_packed

    tokens = torch.arange(3, 3 + 4 * 10).view(4, 10)
    tokens[1, :4], tokens[3, :4] = tokens[0, :4], tokens[2, :4]  # two groups of two rows, 4-token prompts
    response = torch.zeros(4, 10, dtype=torch.bool)
    response[0, 4:7], response[1, 4:9], response[2, 4:6], response[3, 4:5] = True, True, True, True
    packed = plan_packing(tokens, response, max_fraction=1.0)
    assert unpadded_packed(packed.attention_mask).sum(1).tolist() == [4 + 3 + 5, 4 + 2 + 1]
    assert unpadded_packed(packed.attention_mask)[1, 4 + 2 + 1 :].any().item() is False


def test_activation_checkpointing_records_each_router_once():
    """Under activation checkpointing a layer's forward runs again in the backward: the routers' records are the
    forward's only (a recomputed record would join the next micro-batch's loss, whose backward would then reach a
    graph already freed). Records never popped are the last forward's only."""
    from torch.utils.checkpoint import checkpoint

    from forge_rl.models.moe_aux import RouterStats
    from forge_rl.models.qwen3 import build_model

    model, _ = build_model(TINY_MOE)
    stats = RouterStats(model.train())
    tokens = torch.randint(3, 99, (2, 16), generator=torch.Generator().manual_seed(0))
    for _ in range(2):  # two micro-batches
        out = checkpoint(model, tokens, use_reentrant=False)
        assert len(stats.records) == 4
        (out.float().square().mean() + stats.pop_loss()).backward()
        assert stats.records == []
    for _ in range(3):  # forwards nobody pops (PPO's critic shares the trainer's config): the last one's records
        model(tokens).float().mean().backward()
    assert len(stats.records) == 4


def _config(tmp_path, **parallel) -> TrainerConfig:
    return TrainerConfig(
        model=TINY_MOE,
        parallel=ParallelConfig(**parallel),
        optim=OptimizerConfig(lr=1e-3),
        checkpoint_dir=str(tmp_path / "ckpt"),
        share_prompts=False,
        publish_block_mb=0.05,
    )


def test_expert_parallel_ranks_match_one_proc_and_publish_their_own_experts(loop, tmp_path):
    """EP 2 (FSDP 2, each rank 2 of the 4 experts, tokens exchanged by gloo all-to-all, activation checkpointing)
    against one proc: loss and gradient norm over 3 AdamW steps. Before training, each EP rank writes its own
    experts into the published version (HF per-expert names), which equals the checkpoint bit for bit. The EP
    ranks' DCP checkpoint after step 1, loaded after step 3, gives step 2 again exactly."""
    from forge_rl.runtime import stop_actor
    from forge_rl.weights import ShmWeightStore

    shipped = load_file(f"{TINY_MOE}/model.safetensors")
    store = ShmWeightStore()  # the run id of the loop fixture's provisioner (env FORGE_RL_RUN_ID)

    def run(cfg, procs):
        trainer = loop.run_until_complete(Trainer.options(procs=procs, spmd=True).as_actor(cfg))
        pushed = loop.run_until_complete(trainer.push_weights.call(procs)) if procs > 1 else None

        def step(s):
            return loop.run_until_complete(trainer.step.call(split(make_batch(s), procs))).item(procs=0)

        out = [step(0)]
        saved = loop.run_until_complete(trainer.save.call()).item(procs=0)  # DCP, each EP rank its own experts
        out += [step(1), step(2)]
        if procs > 1:  # resume: the step-1 state back (weights, AdamW's moments, schedule), the same next step
            assert loop.run_until_complete(trainer.load.call(saved)).item(procs=0) == 1
            again = step(1)
            assert (again["loss"], again["grad_norm"]) == (out[1]["loss"], out[1]["grad_norm"]), (again, out[1])
        loop.run_until_complete(stop_actor(trainer))
        return out, pushed

    try:
        expected, _ = run(_config(tmp_path / "one"), 1)
        # activation checkpointing too: it renames the layers' parameters, which publishing must map to HF names
        got, pushed = run(_config(tmp_path / "ep", dp_shard=2, ep=2, activation_checkpointing=True), 2)
        published = store.load(2)
        assert set(published) == set(shipped)
        assert all(torch.equal(published[k], shipped[k].float()) for k in shipped)
        # each rank wrote its own blocks: no conversion buffer (fp32 masters published as fp32)
        assert [pushed.item(procs=r)["largest_held_bytes"] for r in range(2)] == [0, 0]
    finally:
        store.close()
    for e, g in zip(expected, got):
        assert abs(e["loss"] - g["loss"]) < 1e-5 and abs(e["grad_norm"] - g["grad_norm"]) < 1e-4, (e, g)
    assert expected[0]["loss"] != expected[1]["loss"] and expected[0]["grad_norm"] > 0


def test_the_trainer_adds_the_load_balancing_loss_when_asked(loop, tmp_path):
    """trainer.moe_aux_loss_coef=1: the step's loss is the policy loss plus the routers' balancing loss over the
    batch (the same forward computed here from the shipped weights)."""
    from forge_rl.models.moe_aux import RouterStats
    from forge_rl.models.moe_aux import unpadded
    from forge_rl.models.qwen3 import build_model
    from forge_rl.runtime import stop_actor

    batch = make_batch(0)
    losses = []
    for coef in (0.0, 1.0):
        cfg = _config(tmp_path / str(coef))
        cfg.moe_aux_loss_coef = coef
        trainer = loop.run_until_complete(Trainer.options(procs=1, spmd=True).as_actor(cfg))
        losses.append(loop.run_until_complete(trainer.step.call([batch])).item(procs=0)["loss"])
        loop.run_until_complete(stop_actor(trainer))
    model, _ = build_model(TINY_MOE)
    stats = RouterStats(model.train())
    with torch.no_grad():
        model(batch.tokens)
    # the trainer counts each row's tokens up to its last response token, as HF's attention mask does (row 0 is padded)
    assert losses[1] - losses[0] == pytest.approx(stats.pop_loss(unpadded(batch.response_mask)).item(), abs=1e-4)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["trainer.lora.rank=8"], "trainer.lora.rank=8: LoRA is not supported on a mixture-of-experts model"),
        (
            ["trainer.parallel.tp=2", "trainer_procs=2"],
            "trainer.parallel.tp=2: tensor parallelism is not supported on a mixture-of-experts model",
        ),
        (["trainer.parallel.ep=3", "trainer_procs=3"], "trainer.parallel.ep=3 must divide the model's 4 experts"),
    ],
)
def test_moe_settings_the_trainer_cannot_take_are_refused_by_name(overrides, message):
    from forge_rl.models import model_path
    from forge_rl.recipes.grpo import GRPOConfig
    from forge_rl.recipes.grpo_checks import check_moe

    cfg = load_config(GRPOConfig, REPO / "configs/grpo/tiny.yaml", ["model=tiny-moe", *overrides])
    with pytest.raises(ConfigError, match=message):
        check_moe(cfg, model_path(cfg.model))
    dense = load_config(GRPOConfig, REPO / "configs/grpo/tiny.yaml", ["trainer.parallel.ep=2", "trainer_procs=2"])
    with pytest.raises(ConfigError, match="trainer.parallel.ep=2: expert parallelism needs a mixture-of-experts"):
        check_moe(dense, model_path(dense.model))
    dense = load_config(GRPOConfig, REPO / "configs/grpo/tiny.yaml", ["trainer.keep_routing=true"])
    with pytest.raises(
        ConfigError,
        match="trainer.keep_routing=true: Keep Routing replays the experts the engine chose, and tiny-warm is dense",
    ):
        check_moe(dense, model_path(dense.model))
    cached = load_config(
        GRPOConfig,
        REPO / "configs/grpo/tiny.yaml",
        ["model=tiny-moe", "trainer.keep_routing=true", "generator.engine_args.enable_prefix_caching=true"],
    )
    with pytest.raises(ConfigError, match="generator.engine_args.enable_prefix_caching=true with trainer.keep_routing"):
        check_moe(cached, model_path(cached.model))
