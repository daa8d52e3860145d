"""The vLLM GPU tier (`pytest -m gpu tests/gpu/test_gpu_vllm.py`, run by `make gpu-check` where vLLM imports with this
host's torch on CUDA): vLLM on CUDA against the trainer. The trainer-only tier, which needs no vLLM, is
tests/gpu/test_gpu.py."""

import asyncio

import pytest
import torch

from forge_rl.actors.generator import Generator
from forge_rl.actors.trainer import Trainer
from forge_rl.types import Completion, Episode, TrainBatch
from tests.gpu.test_gpu import _trainer_config, model_0_6b  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.gpu, pytest.mark.integration]


def test_vllm_behaviour_logprobs_match_the_trainers_bf16_forward(loop, model_0_6b, tmp_path):  # noqa: F811
    """The same tokens under the same weights: vLLM's sampled-token logprobs (bf16 engine) against the trainer's
    bf16 forward. bf16 rounding sets the gap, reported and bounded loosely."""
    trainer, generator = loop.run_until_complete(
        asyncio.gather(
            Trainer.options(procs=1, spmd=True, gpus=1, share_gpus=True).as_actor(
                _trainer_config(model_0_6b, tmp_path)
            ),
            Generator.options(replicas=1, gpus=1, share_gpus=True).as_service(
                str(model_0_6b),
                engine_args=dict(dtype="bfloat16", gpu_memory_utilization=0.3, max_model_len=512),
                sampling=dict(temperature=1.0, max_tokens=32),
            ),
        )
    )
    group: list[Completion] = loop.run_until_complete(generator.generate.route([5, 6, 7, 8, 9, 10], n=8))
    batch = TrainBatch.collate([Episode(c, advantage=0.0) for c in group], pad_id=0)
    trainer_lp = loop.run_until_complete(trainer.logprobs.call(batch)).get(0)
    gap = (trainer_lp - batch.behaviour_logprobs)[batch.response_mask].abs()
    print(
        f"vLLM (bf16, CUDA) vs trainer (bf16) logprobs over {int(batch.response_mask.sum())} tokens: "
        f"mean |gap| {gap.mean():.4f}, max {gap.max():.4f} nats"
    )
    assert gap.mean() < 0.05 and gap.max() < 1.0


def test_a_cuda_engine_returns_every_positions_experts_for_keep_routing(loop):
    """Keep Routing on a GPU engine: vLLM's own routed experts (enable_return_routed_experts, Model Runner V2) become
    the completion's routes, one per position the engine ran, and are the experts transformers' routers choose on
    the same sequence (fp32 engine, tiny-moe; a near-tie may fall the other way on CUDA kernels: 99% asked)."""
    from transformers import AutoModelForCausalLM

    from forge_rl.models import resolve_model_path
    from tests.unit.models.test_keep_routing import hf_routes

    tiny_moe = resolve_model_path("tiny-moe")
    generator = loop.run_until_complete(
        Generator.options(replicas=1, gpus=1, share_gpus=True).as_service(
            str(tiny_moe),
            engine_args=dict(dtype="float32", gpu_memory_utilization=0.2, max_model_len=128),
            record_routes=True,
        )
    )
    group = loop.run_until_complete(
        generator.generate.route([5, 17, 33, 40, 41, 9, 3], n=4, temperature=1.0, max_tokens=16)
    )
    hf = AutoModelForCausalLM.from_pretrained(tiny_moe, dtype=torch.float32).eval()
    same = total = 0
    for c in group:
        ids = torch.cat([c.prompt_ids, c.response_ids]).tolist()
        assert tuple(c.routes.shape) == (len(ids) - 1, 4, 2)
        equal = (c.routes.long().sort(-1).values == hf_routes(hf, ids)[: len(ids) - 1]).all(-1)
        same, total = same + int(equal.sum()), total + equal.numel()
    print(f"vLLM (CUDA, fp32) routes equal to transformers' at {same} of {total} (position, layer) pairs")
    assert same >= 0.99 * total
