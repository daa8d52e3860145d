"""LoRA: adapters on TorchTitan's Qwen3 (frozen base, same under FSDP2 and TP), adapter-only weight sync into
a running vLLM engine with trainer parity, adapter-only checkpoints, and PEFT/merged export round trips."""

import pytest
import torch

from forge_rl.actors.trainer import Trainer
from forge_rl.actors.trainer_config import OptimizerConfig, ParallelConfig, TrainerConfig
from forge_rl.models import TINY_MODEL_DIR
from forge_rl.models.lora import initial_adapters, split_qkv_rows, to_peft
from forge_rl.models.lora_config import LoRAConfig
from tests.integration.test_trainer import make_batch, split

LORA = LoRAConfig(rank=4, alpha=8.0)


def lora_config(tmp_path, lora: LoRAConfig = LORA, **parallel) -> TrainerConfig:
    return TrainerConfig(
        model="tiny",
        lora=lora,
        parallel=ParallelConfig(**parallel),
        optim=OptimizerConfig(lr=2e-2),
        checkpoint_dir=str(tmp_path / "ckpt"),
    )


# ---- config and names (no actors) ---------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(rank=-1), r"trainer\.lora\.rank must be >= 0"),
        (dict(rank=8, alpha=0), r"trainer\.lora\.alpha must be > 0"),
        (dict(rank=8, dropout=1.0), r"trainer\.lora\.dropout must be in \[0, 1\)"),
        (
            dict(rank=8, targets=["q_proj", "v_proj"]),
            r"\['q_proj', 'v_proj'\] without the rest of q_proj, k_proj, v_proj",
        ),
        (dict(rank=8, targets=["lm_head"]), r"trainer\.lora\.targets: \['lm_head'\] are not Qwen3 linears"),
        (dict(rank=8, targets=[]), r"trainer\.lora\.targets is empty"),
        (dict(rank=600), r"trainer\.lora\.rank=600: vLLM serves LoRA ranks up to 512"),
    ],
)
def test_bad_lora_config_names_the_key(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LoRAConfig(**kwargs)


def test_vllm_lora_rank_is_rounded_up_to_what_vllm_serves():
    from forge_rl.actors.generator_engine import lora_engine_args

    assert [lora_engine_args(r)["max_lora_rank"] for r in (1, 4, 8, 9, 512)] == [1, 8, 8, 16, 512]
    with pytest.raises(ValueError, match=r"trainer\.lora\.rank=600"):
        lora_engine_args(600)


def test_fused_qkv_adapter_becomes_three_peft_modules_sharing_a():
    """TorchTitan's wqkv rows are grouped per KV head ([q x heads_per_kv, k, v] per group): the split must
    give PEFT's q/k/v rows in HF order, the same split TorchTitan applies to the weight itself."""
    head_dim, heads_per_kv, n_kv = 2, 2, 3
    rows = torch.arange(n_kv * (heads_per_kv + 2) * head_dim, dtype=torch.float32)[:, None]
    q, k, v = split_qkv_rows(rows, head_dim, heads_per_kv)
    assert q[:, 0].tolist() == [0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19]
    assert k[:, 0].tolist() == [4, 5, 12, 13, 20, 21] and v[:, 0].tolist() == [6, 7, 14, 15, 22, 23]
    shapes = {
        "layers.0.attention.qkv_linear.wqkv.lora_a.weight": (4, 16),
        "layers.0.attention.qkv_linear.wqkv.lora_b.weight": (24, 4),
        "layers.0.feed_forward.w2.lora_a.weight": (4, 32),
        "layers.0.feed_forward.w2.lora_b.weight": (16, 4),
    }
    adapters = initial_adapters(shapes, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(adapters.values(), initial_adapters(shapes, seed=0).values()))
    assert not adapters["layers.0.feed_forward.w2.lora_b.weight"].any()  # B = 0: training starts at the base
    peft = to_peft(adapters, head_dim, heads_per_kv)
    p = "base_model.model.model.layers.0."
    assert sorted(peft) == sorted(
        f"{p}{m}.lora_{ab}.weight"
        for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.down_proj")
        for ab in "AB"
    )
    assert torch.equal(peft[f"{p}self_attn.k_proj.lora_A.weight"], adapters[next(iter(shapes))])
    assert peft[f"{p}self_attn.q_proj.lora_B.weight"].shape == (12, 4)


# ---- the trainer ----------------------------------------------------------------------------------


def run(loop, coro):
    return loop.run_until_complete(coro)


def train(loop, trainer, n_dp: int, seeds=(0, 1)) -> list[dict]:
    return [run(loop, trainer.step.call(split(make_batch(s), n_dp))).get(0) for s in seeds]


@pytest.fixture(scope="module")
def generator(loop):
    """A LoRA generator, started before anything is published: it serves version 0, the base model."""
    from forge_rl.actors.generator import Generator

    svc = run(
        loop,
        Generator.options(replicas=1).as_service(str(TINY_MODEL_DIR), engine_args=dict(max_model_len=128), lora=LORA),
    )
    yield svc
    run(loop, svc.shutdown())


@pytest.fixture(scope="module")
def trained(loop, generator, tmp_path_factory):
    """A one-proc LoRA trainer after two steps, shared by the tests that only read it."""
    trainer = run(loop, Trainer.options(spmd=True).as_actor(lora_config(tmp_path_factory.mktemp("one"))))
    return trainer, train(loop, trainer, 1)


def test_only_adapters_train_and_fsdp_and_tp_match_one_proc(loop, trained, tmp_path):
    """Adapters start the same whatever the parallelism (initial_adapters), so FSDP2 and TP steps equal
    the one-proc steps; the published version is the adapter alone, and the base never moves."""
    from safetensors.torch import load_file

    from forge_rl.runtime import stop_actor
    from forge_rl.weights import ShmWeightStore

    single, expected = trained
    for procs, parallel in ((2, dict(dp_shard=2)), (2, dict(dp_shard=1, tp=2))):
        trainer = run(loop, Trainer.options(procs=procs, spmd=True).as_actor(lora_config(tmp_path, **parallel)))
        got = train(loop, trainer, parallel["dp_shard"])
        run(loop, stop_actor(trainer))
        for e, g in zip(expected, got):
            assert abs(e["loss"] - g["loss"]) < 1e-5 and abs(e["grad_norm"] - g["grad_norm"]) < 1e-4, parallel
    assert expected[0]["grad_norm"] > 0 and expected[0]["loss"] != expected[1]["loss"]
    store = ShmWeightStore()
    try:
        record = run(loop, single.push_weights.call_one(7))
        published = store.load(7)
    finally:
        store.close()
    shipped = load_file(TINY_MODEL_DIR / "model.safetensors")
    assert all(".lora_A." in k or ".lora_B." in k for k in published) and len(published) == 4 * 7 * 2
    full_bytes = sum(t.nbytes for t in shipped.values())
    assert record["bytes"] == sum(t.nbytes for t in published.values()) < full_bytes / 10
    assert any(t.abs().sum() > 0 for k, t in published.items() if ".lora_B." in k)  # the steps moved B
    # the base is frozen: the merged export differs from the shipped weights only by B @ A
    out = run(loop, single.export_hf.call_one(str(tmp_path / "merged")))
    merged = load_file(f"{out}/model.safetensors")
    assert torch.equal(merged["model.embed_tokens.weight"], shipped["model.embed_tokens.weight"])
    assert torch.equal(merged["model.norm.weight"], shipped["model.norm.weight"])
    assert not torch.equal(
        merged["model.layers.0.mlp.down_proj.weight"], shipped["model.layers.0.mlp.down_proj.weight"]
    )


def test_checkpoint_holds_the_adapters_and_resumes_identically(loop, trained, tmp_path):
    import os

    from forge_rl.runtime import stop_actor

    single, _ = trained
    path = run(loop, single.save.call_one(None, str(tmp_path / "ckpt")))
    expected = train(loop, single, 1, seeds=(3, 4))
    stored = sum(f.stat().st_size for f in os.scandir(path) if f.is_file())
    assert stored < (TINY_MODEL_DIR / "model.safetensors").stat().st_size  # adapters + their Adam state only
    second = run(loop, Trainer.options(spmd=True).as_actor(lora_config(tmp_path)))
    assert run(loop, second.load.call_one(path)) == 2
    got = train(loop, second, 1, seeds=(3, 4))
    run(loop, stop_actor(second))
    for e, g in zip(expected, got):
        assert e["loss"] == pytest.approx(g["loss"], abs=1e-7) and e["step"] == g["step"]


def test_peft_adapter_and_merged_export_reproduce_the_trainer(loop, trained, tmp_path):
    """The PEFT adapter on the base model (peft) and the merged HF export (transformers) give the
    trainer's own logprobs."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    single, _ = trained
    adapter_dir = run(loop, single.export_adapter.call_one(str(tmp_path / "adapter")))
    merged_dir = run(loop, single.export_hf.call_one(str(tmp_path / "merged")))
    probe = make_batch(5)
    ours = run(loop, single.logprobs.call_one(probe))[:, 1:]

    def logprobs(model):
        with torch.no_grad():
            logp = torch.log_softmax(model(probe.tokens).logits.float(), -1)
        return logp[:, :-1].gather(-1, probe.tokens[:, 1:, None])[..., 0]

    base = AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR, dtype=torch.float32).eval()
    with_adapter = PeftModel.from_pretrained(base, adapter_dir).eval()
    assert (logprobs(with_adapter) - ours).abs().max().item() < 1e-5
    with with_adapter.disable_adapter():  # the check has teeth: without the adapter it is far off
        assert (logprobs(with_adapter) - ours).abs().max().item() > 1e-3
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    assert (logprobs(merged) - ours).abs().max().item() < 1e-5


def test_vllm_serves_each_adapter_version_with_the_trainers_logprobs(loop, trained, generator):
    """The generator adds each published adapter to its running engine (no pause, no base reload): its
    behaviour logprobs equal the trainer's to 1e-4 in fp32, and tokens carry the adapter's version."""
    from forge_rl.types import Episode, TrainBatch
    from tests.integration.test_generator import PROMPT

    single, svc = trained[0], generator
    base = run(loop, svc.generate.route(PROMPT, n=8, temperature=1.0, max_tokens=12))
    run(loop, single.push_weights.call_one(8))
    record = run(loop, svc.update_weights.call_all(8))[0]
    completions = run(loop, svc.generate.route(PROMPT, n=8, temperature=1.0, max_tokens=12))
    assert record["mode"] == "adapter" and record["pause_s"] == 0.0
    assert all(c.policy_versions.eq(0).all() for c in base) and all(c.policy_versions.eq(8).all() for c in completions)
    batch = TrainBatch.collate([Episode(c, advantage=0.0) for c in completions], pad_id=0)
    ours = run(loop, single.logprobs.call_one(batch))
    assert (ours - batch.behaviour_logprobs)[batch.response_mask].abs().max().item() < 1e-4
    # version 0 was the base model, which the trained adapter no longer reproduces
    base_batch = TrainBatch.collate([Episode(c, advantage=0.0) for c in base], pad_id=0)
    moved = run(loop, single.logprobs.call_one(base_batch))
    assert (moved - base_batch.behaviour_logprobs)[base_batch.response_mask].abs().max().item() > 1e-3
