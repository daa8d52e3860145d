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
