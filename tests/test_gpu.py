"""The GPU tier (`pytest -m gpu`, run by `make gpu-check`): what only a CUDA device can show. Skipped where no
GPU is visible, with that reason; the logic of every CUDA-only branch is tested on CPU (tests/test_gpu_logic.py,
tests/test_resources.py, the memory plan's tests).

A Qwen3-0.6B-shaped model (hidden 1024, 28 layers, the real 151,936-entry vocabulary), random weights, built
once per session: the trainer takes one FSDP2 bf16 step of it with fp32 master weights, and vLLM on CUDA
samples from it with behaviour logprobs that the trainer's bf16 forward reproduces."""

import asyncio
import math

import pytest
import torch

from forge_rl.actors.generator import Generator
from forge_rl.actors.trainer import OptimizerConfig, Trainer, TrainerConfig
from forge_rl.models.build_tiny import build
from forge_rl.types import Completion, Episode, TrainBatch

pytestmark = [pytest.mark.gpu, pytest.mark.integration]

QWEN3_0_6B_SHAPE = dict(hidden_size=1024, num_hidden_layers=28, intermediate_size=3072, vocab_size=151936,
                        num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                        max_position_embeddings=4096, torch_dtype="bfloat16")


@pytest.fixture(scope="module")
def model_0_6b(tmp_path_factory):
    return build(tmp_path_factory.mktemp("qwen3-0.6b-shape"), **QWEN3_0_6B_SHAPE)


def _trainer_config(model_dir, tmp_path) -> TrainerConfig:
    return TrainerConfig(model=str(model_dir), dtype="bfloat16", optim=OptimizerConfig(lr=1e-5),
                         checkpoint_dir=str(tmp_path / "ckpt"))


def test_fsdp2_bf16_train_step_of_a_0_6b_shaped_model(loop, model_0_6b, tmp_path):
    trainer = loop.run_until_complete(Trainer.options(procs=1, spmd=True, gpus=1, share_gpus=True).as_actor(
        _trainer_config(model_0_6b, tmp_path)))
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, 128, (8, 256), generator=g)
    mask = torch.zeros_like(tokens, dtype=torch.bool)
    mask[:, 64:] = True
    batch = TrainBatch(tokens, mask, -torch.rand(8, 256, generator=g) * mask, torch.where(mask, 0, -1),
                       torch.randn(8, generator=g))
    metrics = loop.run_until_complete(trainer.train_step.call([batch])).get(0)
    assert math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"]) and metrics["grad_norm"] > 0
    assert metrics["skipped"] == 0.0


def test_vllm_behaviour_logprobs_match_the_trainers_bf16_forward(loop, model_0_6b, tmp_path):
    """The same tokens under the same weights: vLLM's sampled-token logprobs (bf16 engine) against the trainer's
    bf16 forward. bf16 rounding sets the gap, reported and bounded loosely."""
    trainer, generator = loop.run_until_complete(asyncio.gather(
        Trainer.options(procs=1, spmd=True, gpus=1, share_gpus=True).as_actor(_trainer_config(model_0_6b, tmp_path)),
        Generator.options(replicas=1, gpus=1, share_gpus=True).as_service(
            str(model_0_6b), engine_args=dict(dtype="bfloat16", gpu_memory_utilization=0.3, max_model_len=512),
            sampling=dict(temperature=1.0, max_tokens=32)),
    ))
    group: list[Completion] = loop.run_until_complete(generator.generate.route([5, 6, 7, 8, 9, 10], n=8))
    batch = TrainBatch.collate([Episode(c, advantage=0.0) for c in group], pad_id=0)
    trainer_lp = loop.run_until_complete(trainer.logprobs.call(batch)).get(0)
    gap = (trainer_lp - batch.behaviour_logprobs)[batch.response_mask].abs()
    print(f"vLLM (bf16, CUDA) vs trainer (bf16) logprobs over {int(batch.response_mask.sum())} tokens: "
          f"mean |gap| {gap.mean():.4f}, max {gap.max():.4f} nats")
    assert gap.mean() < 0.05 and gap.max() < 1.0


def test_both_publish_paths_copy_cuda_weights_into_shared_memory_bit_exact(loop, model_0_6b, tmp_path):
    """fp32 masters on the GPU published in bf16 by shard writes and from rank 0 (as ranks on several hosts do):
    each tensor, or block of rows, is converted on the device and copied straight into the version's shared
    memory; both give back the bf16 checkpoint the masters were loaded from, bit-exact."""
    from safetensors.torch import load_file

    from forge_rl.runtime import stop_actor
    from forge_rl.weights import ShmWeightStore

    want = {}
    for file in sorted(model_0_6b.glob("*.safetensors")):
        want |= load_file(file)
    store = ShmWeightStore()
    try:
        for version, publish_from in enumerate(("auto", "rank0"), 1):
            cfg = _trainer_config(model_0_6b, tmp_path / publish_from)
            cfg.publish_from, cfg.publish_block_mb = publish_from, 16.0
            trainer = loop.run_until_complete(Trainer.options(procs=1, spmd=True, gpus=1, share_gpus=True)
                                              .as_actor(cfg))
            record = loop.run_until_complete(trainer.push_weights.call(version)).get(0)
            loop.run_until_complete(stop_actor(trainer))
            got = store.load(version)
            assert set(want) <= set(got), sorted(set(want) - set(got))[:3]
            for name, tensor in want.items():
                assert torch.equal(got[name], tensor), (publish_from, name)
            assert torch.equal(got["lm_head.weight"], want["model.embed_tokens.weight"])  # tied
            if publish_from == "rank0":
                assert 0 < record["largest_held_bytes"] <= 16 * 2**20
            del got
    finally:
        store.close()


def test_critic_steps_on_the_gpu_and_gives_its_cached_memory_back(loop, model_0_6b, tmp_path):
    """The critic time-sharing a GPU (release_memory_after_step, as a colocated PPO run sets it): a bf16 value step
    of the 0.6B-shaped model with fp32 masters, after which its caching allocator keeps only what its tensors
    use; the step's activations went back to the device for the engine to wake into."""
    from forge_rl.actors.critic import Critic
    from forge_rl.runtime import stop_actor
    from tests.actors import CudaMemory
    from tests.test_critic import valued
    from tests.test_trainer import make_batch

    cfg = _trainer_config(model_0_6b, tmp_path)
    cfg.release_memory_after_step = True
    critic = loop.run_until_complete(Critic.options(procs=1, spmd=True, gpus=1, share_gpus=True)
                                     .as_actor(cfg, value_clip=0.2, epochs=1))
    try:
        memory = critic._forge_proc_mesh.spawn("cuda_memory", CudaMemory)
        batches = valued(loop, critic, [make_batch(0)])
        metrics = loop.run_until_complete(critic.train_step.call(batches)).get(0)
        assert math.isfinite(metrics["value_loss"]) and metrics["grad_norm"] > 0 and metrics["step"] == 1
        after = loop.run_until_complete(memory.read.call_one())
        print(f"critic on the GPU: peak reserved {after['max_reserved'] / 2**30:.2f} GiB, after the step reserved "
              f"{after['reserved'] / 2**30:.2f} GiB for {after['allocated'] / 2**30:.2f} GiB allocated")
        assert after["reserved"] - after["allocated"] <= 64 * 2**20
        assert after["max_reserved"] > after["reserved"]
    finally:
        loop.run_until_complete(stop_actor(critic))


def test_a_classifier_reward_model_scores_in_bf16_on_the_gpu(loop, tmp_path):
    """A one-label classifier reward model placed on a GPU loads in bf16 and scores a group as transformers does in
    fp32, to bf16's rounding."""
    from forge_rl.actors.reward_model import RewardModel
    from forge_rl.runtime import stop_actor
    from tests.test_reward_model import ANSWERS, QUESTIONS, make_classifier, transformers_scores

    path = make_classifier(tmp_path / "tiny_rm")
    rm = loop.run_until_complete(RewardModel.options(gpus=1, share_gpus=True).as_actor(str(path), 64, 10.0))
    try:
        got = loop.run_until_complete(rm.score.call_one([QUESTIONS[0]] * 3, ANSWERS[0]))
        want = transformers_scores(path, [QUESTIONS[0]] * 3, ANSWERS[0])
        assert got == pytest.approx(want, rel=0.05, abs=0.1)
        assert len({round(v, 2) for v in got}) > 1  # it tells the completions apart
    finally:
        loop.run_until_complete(stop_actor(rm))
