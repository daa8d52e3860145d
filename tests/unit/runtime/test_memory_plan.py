"""The memory plan of a colocated GPU, against hand-computed figures for Qwen3-0.6B, 1.7B and 8B on an 80 GB GPU
(pure arithmetic; GB = 1e9 bytes)."""

import json

import pytest

from forge_rl.config import ConfigError
from forge_rl.runtime.memory_plan import (
    ENGINE_OVERHEAD_GB,
    GB,
    LM_HEAD_MEMORY_GB,
    MARGIN_GB,
    TRAINER_OVERHEAD_GB,
    ModelShape,
    main,
    plan_memory,
    size_one_gpu,
)

QWEN3 = dict(model_type="qwen3", vocab_size=151936, num_key_value_heads=8, head_dim=128)
CONFIGS = {
    "Qwen3-0.6B": dict(
        QWEN3,
        hidden_size=1024,
        num_hidden_layers=28,
        intermediate_size=3072,
        num_attention_heads=16,
        tie_word_embeddings=True,
    ),
    "Qwen3-1.7B": dict(
        QWEN3,
        hidden_size=2048,
        num_hidden_layers=28,
        intermediate_size=6144,
        num_attention_heads=16,
        tie_word_embeddings=True,
    ),
    "Qwen3-8B": dict(
        QWEN3,
        hidden_size=4096,
        num_hidden_layers=36,
        intermediate_size=12288,
        num_attention_heads=32,
        tie_word_embeddings=False,
    ),
}
# Per layer: q h*16*128 (32*4096 for 8B), k and v h*8*128 each, o = q, MLP 3*h*I, two norms 2*h, q/k norms 2*128.
# 0.6B: embed 151936*1024 = 155,582,464; layer 2,097,152 + 2*1,048,576 + 2,097,152 + 9,437,184 + 2,048 + 256
#       = 15,730,944, x28 = 440,466,432; final norm 1,024 -> 596,049,920
# 1.7B: embed 151936*2048 = 311,164,928; layer 4,194,304 + 2*2,097,152 + 4,194,304 + 37,748,736 + 4,096 + 256
#       = 50,336,000, x28 = 1,409,408,000; final norm 2,048 -> 1,720,574,976 (the model card's "1.7B" rounds 1.72B)
# 8B:   embed + untied lm_head 2*151936*4096 = 1,244,659,712; layer 16,777,216 + 2*4,194,304 + 16,777,216
#       + 150,994,944 + 8,192 + 256 = 192,946,432, x36 = 6,946,071,552; final norm 4,096 -> 8,190,735,360
PARAMS = {"Qwen3-0.6B": 596_049_920, "Qwen3-1.7B": 1_720_574_976, "Qwen3-8B": 8_190_735_360}
NOMINAL = {"Qwen3-0.6B": 0.6e9, "Qwen3-1.7B": 1.7e9, "Qwen3-8B": 8.2e9}
KV_BYTES = {"Qwen3-0.6B": 2 * 28 * 8 * 128 * 2, "Qwen3-1.7B": 2 * 28 * 8 * 128 * 2, "Qwen3-8B": 2 * 36 * 8 * 128 * 2}
ONE_GPU = dict(micro_batch=4, seq_len=2048, max_model_len=2048)


def shape(name):
    return ModelShape.from_config(CONFIGS[name], name)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_parameter_count_and_kv_bytes(name):
    assert shape(name).parameters() == PARAMS[name]
    # within 1% of the nominal size (1.7B: the exact count is 1.72B, 1.2% above the model card's rounded figure)
    assert abs(PARAMS[name] / NOMINAL[name] - 1) < (0.013 if name == "Qwen3-1.7B" else 0.01)
    assert shape(name).kv_bytes_per_token() == KV_BYTES[name]  # 114,688 / 114,688 / 147,456 bytes (bf16)


def test_small_models_fit_one_80gb_gpu_with_everything_on_it():
    for name, want_util in (("Qwen3-0.6B", 0.843), ("Qwen3-1.7B", 0.618)):
        verdict, plan = size_one_gpu(shape(name), 80e9, **ONE_GPU)
        p = PARAMS[name]
        assert verdict == "fits" and not plan.offload_optimizer
        # fp32 params + grads + Adam m, v = 16 bytes/param, + 1 GB CUDA context: 0.6B 10.54 GB, 1.7B 28.53 GB
        assert plan.trainer_resident_gb == pytest.approx(16 * p / GB + TRAINER_OVERHEAD_GB)
        assert plan.engine_weights_gb == pytest.approx(2 * p / GB)  # bf16: 1.19 GB, 3.44 GB
        # (80 - resident - 2 GB margin) / 80, rounded down: 0.6B (80-10.54-2)/80 = 0.8433; 1.7B (80-28.53-2)/80 = 0.6184
        assert plan.gpu_memory_utilization == want_util
        kv = (want_util * 80 - 2 * p / GB - ENGINE_OVERHEAD_GB) * GB / KV_BYTES[name]  # 560,197 / 383,639 tokens
        assert plan.kv_tokens == pytest.approx(kv, abs=2)
        # activations with checkpointing: 4*2048 tokens * h * (2*28 + 34) bytes = 0.75 / 1.51 GB, and the fused
        # lm_head's working memory: its 1 GiB budget (the micro-batch's logits would take 4*2048 * 151936 * 10 bytes)
        assert plan.activations_gb == pytest.approx(
            4 * 2048 * CONFIGS[name]["hidden_size"] * 90 / GB + LM_HEAD_MEMORY_GB
        )
        assert plan.warnings == []


def test_a_ppo_critic_on_the_trainers_gpu_counts_its_16_bytes_per_parameter():
    p = PARAMS["Qwen3-0.6B"]
    alone = plan_memory(shape("Qwen3-0.6B"), 80e9, **ONE_GPU)
    with_critic = plan_memory(shape("Qwen3-0.6B"), 80e9, critic_params=p, **ONE_GPU)
    # a trained critic of the policy's size: fp32 params, grads and Adam's moments again, 9.54 GB
    assert with_critic.trainer_resident_gb - alone.trainer_resident_gb == pytest.approx(16 * p / GB)
    assert with_critic.gpu_memory_utilization < alone.gpu_memory_utilization
    # four ranks share it
    four = plan_memory(shape("Qwen3-0.6B"), 80e9, trainer_ranks=4, critic_params=p)
    assert four.trainer_resident_gb - plan_memory(
        shape("Qwen3-0.6B"), 80e9, trainer_ranks=4
    ).trainer_resident_gb == pytest.approx(4 * p / GB)


def test_8b_needs_the_optimizer_offloaded_and_is_refused_without_it():
    without = plan_memory(shape("Qwen3-8B"), 80e9, **ONE_GPU)
    # 16 * 8.19B = 131.05 GB of states (+ 1 GB context) on an 80 GB GPU
    assert without.trainer_step_gb == pytest.approx(16 * PARAMS["Qwen3-8B"] / GB + 1) and not without.fits
    for text in (
        "Qwen3-8B (8.19B params)",
        "80.0 GB GPU",
        "132.1 GB",
        "fp32 params 32.8 + grads 32.8 + Adam 65.5 GB",
        "trainer_procs",
        "resources.placement: disaggregated",
    ):
        assert text in without.refusal
    with pytest.raises(ConfigError, match=r"Qwen3-8B .* 132\.1 GB"):
        without.check()
    verdict, plan = size_one_gpu(shape("Qwen3-8B"), 80e9, **ONE_GPU)
    assert verdict == "needs optimizer offload (not built)" and plan.offload_optimizer
    # while generating: fp32 params 32.76 GB (+1); stepping: + grads 32.76 GB = 66.53 GB (+ 3.56 GB activations)
    assert plan.trainer_resident_gb == pytest.approx(4 * PARAMS["Qwen3-8B"] / GB + 1)
    assert plan.trainer_step_gb == pytest.approx(8 * PARAMS["Qwen3-8B"] / GB + 1)
    assert plan.gpu_memory_utilization == 0.552  # (80 - 33.76 - 2) / 80 = 0.5530 -> 0.552 after flooring 552.96
    # (0.552*80 - 16.38 GB bf16 weights - 2 GB) / 147,456 bytes = 174,821 tokens
    assert plan.kv_tokens == pytest.approx(
        (0.552 * 80 - 2 * PARAMS["Qwen3-8B"] / GB - 2) * GB / KV_BYTES["Qwen3-8B"], abs=2
    )


def test_an_engine_that_cannot_hold_its_minimum_kv_is_refused_with_the_numbers():
    # 8B offloaded: 174,821 KV tokens; 64 sequences x 4096 = 262,144 do not fit
    plan = plan_memory(
        shape("Qwen3-8B"),
        80e9,
        offload_optimizer=True,
        micro_batch=4,
        seq_len=2048,
        max_model_len=4096,
        max_num_seqs=64,
    )
    assert not plan.fits
    for text in (
        "Qwen3-8B",
        "33.8 GB",
        "gpu_memory_utilization 0.552 (44.2 GB)",
        "16.4 GB",
        "174,821 tokens",
        "262,144",
        "max_model_len=4096 x max_num_seqs=64",
        "generator.engine_args.max_model_len",
        "generator.engine_args.max_num_seqs",
        "resources.placement: disaggregated",
    ):
        assert text in plan.refusal, text
    # 8B on a 40 GB GPU: even offloaded, a step needs fp32 params + grads = 65.5 GB (+1)
    verdict, on_40 = size_one_gpu(shape("Qwen3-8B"), 40e9, **ONE_GPU)
    assert verdict == "refused" and "fp32 params 32.8 + grads 32.8 GB" in on_40.refusal and "40.0 GB" in on_40.refusal
    assert "offload" not in on_40.refusal  # forge_rl has no optimizer offload to suggest


def test_the_users_gpu_memory_utilization_is_checked_against_the_plan():
    plan = plan_memory(shape("Qwen3-1.7B"), 80e9, **ONE_GPU)
    plan.check(0.6)
    with pytest.raises(ConfigError, match=r"gpu_memory_utilization=0\.85 .* 28\.5 GB .* at most 0\.618"):
        plan.check(0.85)
    with pytest.raises(ConfigError, match=r"gpu_memory_utilization=0\.05 leaves .* 0 KV tokens"):
        plan.check(0.05)
    # configs/grpo/qwen3_1_7b.yaml on four 80 GB GPUs, colocated: 4 FSDP ranks, micro-batch 16 x 2048, its 0.85 fits
    four = plan_memory(shape("Qwen3-1.7B"), 80e9, trainer_ranks=4, micro_batch=16, seq_len=2048, max_model_len=2048)
    assert four.trainer_resident_gb == pytest.approx(16 * PARAMS["Qwen3-1.7B"] / 4 / GB + 1)  # 7.88 GB
    assert four.gpu_memory_utilization == 0.876  # (80 - 7.88 - 2) / 80 = 0.8765
    four.check(0.85)
    # FSDP ranks fuse the lm_head into the logprobs (no logits): 6.0 GB of layer activations, and the embedding's
    # FSDP unit made whole for its forward and backward (bf16 weight + fp32 gradient: 6 x 151936 x 2048 = 1.9 GB);
    # with TP 2 each rank holds half the layers' activations (sequence parallelism), its half of the vocabulary's
    # logits in bf16 (16*2048 tokens * 75968 * 2 bytes = 5.0 GB) and half the unit
    unit = 6 * 151936 * 2048
    assert four.activations_gb == pytest.approx((16 * 2048 * 2048 * 90 + unit) / GB + LM_HEAD_MEMORY_GB)
    tp = plan_memory(shape("Qwen3-1.7B"), 80e9, trainer_ranks=4, trainer_tp=2, micro_batch=16, seq_len=2048)
    assert tp.activations_gb == pytest.approx((16 * 2048 * (2048 * 90 // 2 + 151936 // 2 * 2) + unit // 2) / GB)


def test_activation_formula_and_margin():
    s = shape("Qwen3-1.7B")
    assert s.activation_bytes(8192, checkpointing=False, logits=False) == 8192 * 2048 * 34 * 28
    assert s.activation_bytes(8192, checkpointing=True, logits=False) == 8192 * 2048 * (2 * 28 + 34)
    plan = plan_memory(s, 80e9, micro_batch=64, seq_len=4096, activation_checkpointing=False)
    assert plan.fits and plan.warnings and "trainer.micro_batch_size" in plan.warnings[0]
    assert MARGIN_GB == plan.margin_gb


def test_shape_from_a_config_file_and_the_cli(tmp_path, capsys):
    (tmp_path / "Qwen3-1.7B").mkdir()
    (tmp_path / "Qwen3-1.7B" / "config.json").write_text(json.dumps(CONFIGS["Qwen3-1.7B"]))
    assert ModelShape.from_config(tmp_path / "Qwen3-1.7B").name == "Qwen3-1.7B"
    assert ModelShape.from_config(tmp_path / "Qwen3-1.7B" / "config.json").parameters() == PARAMS["Qwen3-1.7B"]
    with pytest.raises(ValueError, match="hidden_size"):
        ModelShape.from_config({"vocab_size": 3}, "odd")
    out = main(["--gpu-gb", "80"])
    assert "| Qwen3-0.6B |" in out and "| fits |" in out and "| needs optimizer offload (not built) |" in out
    assert main(["--model-config", str(tmp_path / "Qwen3-1.7B"), "--gpu-gb", "8"]).endswith("| refused |")


def test_the_grpo_run_sets_and_checks_gpu_memory_utilization_when_colocated_on_gpus(tmp_path, monkeypatch):
    """RLRun's wiring, with a simulated 4 x 80 GB node (configs/grpo/qwen3_1_7b.yaml's sizes): the plan sets
    gpu_memory_utilization, a user's value above it is refused, and nothing changes off the GPU."""
    import forge_rl.recipes.rl_run as rl_run
    from forge_rl.recipes import startup
    from forge_rl.recipes.grpo_config import GRPOConfig
    from forge_rl.runtime.placement import plan_placement

    model = tmp_path / "Qwen3-1.7B"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(CONFIGS["Qwen3-1.7B"]))
    monkeypatch.setattr(startup, "gpu_total_bytes", lambda gpu: 80_000_000_000)
    cfg = GRPOConfig(model=str(model), trainer_procs=4)
    cfg.generator.replicas, cfg.generator.engine_args = 4, dict(max_model_len=2048, dtype="bfloat16")
    cfg.trainer.micro_batch_size, cfg.trainer.parallel.activation_checkpointing = 16, True
    run = rl_run.RLRun(cfg)
    run.model_dir, run.generator_gpus = str(model), 1
    run.placement = plan_placement(cfg.resources, 4, 4, 1, gpus=["0", "1", "2", "3"])
    assert run.placement.colocated and run.placement.generator_gpus == [["0"], ["1"], ["2"], ["3"]]
    args = startup.engine_args(run, shared=True)
    assert args["gpu_memory_utilization"] == 0.876 and args["enable_sleep_mode"] is True
    assert "gpu_memory_utilization" not in startup.engine_args(run, shared=False)
    run.cfg.generator.engine_args["gpu_memory_utilization"] = 0.95  # the run's own copy of the config
    with pytest.raises(ConfigError, match=r"0\.95 .* at most 0\.876"):
        startup.engine_args(run, shared=True)
    run.cfg.generator.engine_args["gpu_memory_utilization"] = 0.85  # the shipped config's value fits
    assert startup.engine_args(run, shared=True)["gpu_memory_utilization"] == 0.85


def test_a_trainer_sharing_its_gpu_gives_its_cached_memory_back_after_each_step(monkeypatch):
    """The run's placement decides it: colocated on GPUs (a simulated 4-GPU node) the trainer empties CUDA's
    cache after each publish, for the engine's wake-up; disaggregated, or on CPU, it keeps its cache."""
    import forge_rl.recipes.rl_run as rl_run
    from forge_rl.recipes import startup
    from forge_rl.recipes.grpo_config import GRPOConfig

    for gpus, placement, expected in (
        (["0", "1", "2", "3"], "colocated", True),
        (["0", "1", "2", "3"], "disaggregated", False),
        ([], "auto", False),
    ):
        monkeypatch.setattr(startup, "visible_gpus", lambda gpus=gpus: gpus)
        cfg = GRPOConfig(trainer_procs=2)
        cfg.resources.placement = placement
        run = rl_run.RLRun(cfg)
        startup.place(run.cfg, {})
        assert run.cfg.trainer.release_memory_after_step is expected, (gpus, placement)  # the run's own copy


def test_a_mixture_of_experts_counts_every_expert_and_a_layer_made_whole_holds_its_ep_share():
    """Qwen3-30B-A3B: 30.5B parameters (its model card), not the 3.3B its dense intermediate_size would give; FSDP
    makes a layer whole with 1/ep of its experts, so under EP 8 the head is the largest unit again."""
    from dataclasses import replace

    from forge_rl.models import resolve_model_path
    from forge_rl.runtime.memory_plan import QWEN3_SHAPES

    shape = ModelShape.from_config(QWEN3_SHAPES["Qwen3-30B-A3B"], "Qwen3-30B-A3B")
    assert shape.parameters() == pytest.approx(30.5e9, rel=0.005)
    assert replace(shape, num_experts=0).parameters() < 3.4e9
    assert shape.fsdp_unit_bytes(ep=1) == 6 * shape.layer_parameters() > 6 * shape.vocab_size * shape.hidden_size
    assert shape.fsdp_unit_bytes(ep=8) == 6 * shape.vocab_size * shape.hidden_size
    assert shape.layer_activation_bytes() > replace(shape, num_experts=0).layer_activation_bytes()  # 8 routed copies
    tiny = ModelShape.from_config(resolve_model_path("tiny-moe"))
    assert (tiny.num_experts, tiny.num_experts_per_tok, tiny.moe_intermediate_size) == (4, 2, 384)


def test_a_vision_language_models_shape_is_its_language_models_plus_its_vision_towers():
    """tiny-vlm (Idefics3): the plan counts every parameter its checkpoint holds (the tied head once), the language
    model's layers from text_config and the vision tower and connector from vision_config."""
    import math

    from safetensors import safe_open

    from forge_rl.models import resolve_model_path

    model_dir = resolve_model_path("tiny-vlm")
    shape = ModelShape.from_config(model_dir)
    with safe_open(f"{model_dir}/model.safetensors", "pt") as f:
        sizes = {k: math.prod(f.get_slice(k).get_shape()) for k in f.keys() if k != "lm_head.weight"}
    vision = sum(n for k, n in sizes.items() if k.startswith(("model.vision_model.", "model.connector.")))
    assert (shape.parameters(), shape.vision_parameters) == (sum(sizes.values()), vision)
    assert shape.num_hidden_layers == 4 and shape.hidden_size == 128 and not shape.qk_norm  # its Llama


def test_a_vision_towers_activations_are_one_layers_when_frozen_and_every_layers_when_trained():
    """The plan's step counts the tower's activations, every token taken for an image token: a frozen tower holds one
    encoder layer's at a time, a trained one keeps all of its layers' (tiny-vlm: 2 layers of width 64 and MLP 128, 4
    patches an image token: 4 x (4 x 64 + 2 x 128) x 2 bytes a layer a token). trainer.freeze of `vision` or
    `vision.vision_model` freezes the tower; the connector alone does not."""
    from dataclasses import replace

    from forge_rl.models import resolve_model_path
    from forge_rl.runtime.vision_memory import tower_frozen

    shape = ModelShape.from_config(resolve_model_path("tiny-vlm"))
    assert (shape.vision_layers, shape.vision_layer_bytes) == (2, 4 * (4 * 64 + 2 * 128) * 2)
    text = replace(shape, vision_layers=0, vision_layer_bytes=0)

    def tower_gb(trained: bool) -> float:
        args = dict(micro_batch=2, seq_len=100, vision_trained=trained)
        return plan_memory(shape, 80e9, **args).activations_gb - plan_memory(text, 80e9, **args).activations_gb

    assert tower_gb(False) == pytest.approx(200 * shape.vision_layer_bytes / 1e9)
    assert tower_gb(True) == pytest.approx(2 * tower_gb(False))
    assert tower_frozen(["vision"]) and tower_frozen(["vision.vision_model"])
    assert not tower_frozen(["vision.connector"]) and not tower_frozen([])
