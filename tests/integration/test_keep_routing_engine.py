"""Keep Routing's record on a real engine: the generator (a vLLM engine in a Monarch proc, embedded tiny-moe: 4 MoE
layers, 4 experts, top 2) records the experts every position was routed to, the same as transformers' routers on the
same sequence (fp32). What the record goes through afterwards is tests/unit/models/test_keep_routing.py's."""

import asyncio

import pytest
import torch

from forge_rl.models import resolve_model_path

TINY_MOE = resolve_model_path("tiny-moe")
LAYERS, TOP_K = 4, 2


def hf_routes(model, ids: list[int]) -> torch.Tensor:
    """transformers' top-k experts of every position of `ids`: int64 [positions, layers, top-k], sorted."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_router_logits=True)
    return torch.stack([logits.topk(TOP_K, -1).indices for logits in out.router_logits], 1).sort(-1).values


@pytest.fixture(scope="module")
def generator():
    from forge_rl.actors.generator import Generator
    from forge_rl.runtime import provisioned

    loop = asyncio.new_event_loop()
    ctx = provisioned()
    loop.run_until_complete(ctx.__aenter__())
    actor = loop.run_until_complete(
        Generator.as_actor(str(TINY_MOE), engine_args=dict(max_model_len=128), record_routes=True)
    )
    yield loop, actor
    loop.run_until_complete(ctx.__aexit__(None, None, None))
    loop.close()


def test_the_generator_records_every_positions_experts_as_transformers_routes_them(generator):
    from transformers import AutoModelForCausalLM

    loop, actor = generator
    hf = AutoModelForCausalLM.from_pretrained(TINY_MOE, dtype=torch.float32).eval()
    completions = loop.run_until_complete(
        actor.generate.call_one([5, 17, 33, 40, 41, 9, 3, 12], n=4, temperature=1.0, max_tokens=10)
    )
    completions += loop.run_until_complete(actor.generate.call_one([7, 8, 9], n=1, temperature=1.0, max_tokens=5))
    for c in completions:
        ids = torch.cat([c.prompt_ids, c.response_ids]).tolist()
        assert c.routes.dtype == torch.uint8 and tuple(c.routes.shape) == (len(ids) - 1, LAYERS, TOP_K)
        assert torch.equal(c.routes.long().sort(-1).values, hf_routes(hf, ids)[: len(ids) - 1])
    stats = loop.run_until_complete(actor.stats.call_one())
    assert stats["routes_bytes_per_token"] == LAYERS * TOP_K  # one byte an id: 4 experts
