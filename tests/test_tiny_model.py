"""The embedded tiny model: reproducible build, and the same model in transformers, TorchTitan and vLLM."""

import asyncio
import os

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from forge_rl.models import TINY_MODEL_DIR, resolve_model_path
from forge_rl.models.build_tiny import build

PROMPT = "<|im_start|>user\n12+34=<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def hf_model():
    return AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR, dtype=torch.float32).eval()


def test_build_reproduces_the_shipped_files(tmp_path):
    build(tmp_path)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / name).read_bytes() == (TINY_MODEL_DIR / name).read_bytes(), name
    rebuilt, shipped = load_file(tmp_path / "model.safetensors"), load_file(TINY_MODEL_DIR / "model.safetensors")
    assert rebuilt.keys() == shipped.keys()
    assert all(torch.equal(rebuilt[k], shipped[k]) for k in shipped)


def test_tokenizer_is_character_level_with_chat_template():
    tok = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    text = tok.apply_chat_template([{"role": "user", "content": "12+34="}], tokenize=False, add_generation_prompt=True)
    assert text == PROMPT
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len("user\n12+34=" "\n" "assistant\n") + 3  # one id per char, specials are single ids
    assert tok.decode(ids) == text and tok.eos_token_id == 2 and tok.pad_token_id == 0


def test_hf_and_torchtitan_logits_match(hf_model):
    from forge_rl.models.qwen3 import build_model

    titan, _ = build_model(TINY_MODEL_DIR)
    assert sum(p.numel() for p in titan.parameters()) == sum(p.numel() for p in hf_model.parameters())
    tokens = torch.randint(3, 99, (3, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        gap = (titan(tokens) - hf_model(tokens).logits).abs().max().item()
    assert gap < 1e-4


def test_model_path_errors_name_the_path(tmp_path):
    assert resolve_model_path("tiny") == str(TINY_MODEL_DIR)
    with pytest.raises(FileNotFoundError, match=f"{tmp_path}.*config.json"):
        resolve_model_path(str(tmp_path))


# ---- vLLM (one engine shared by the tests below) ---------------------------------------------


@pytest.fixture(scope="module")
def generator():
    from forge_rl.actors.generator import Generator
    from forge_rl.controller import provisioned

    loop = asyncio.new_event_loop()
    ctx = provisioned()
    loop.run_until_complete(ctx.__aenter__())
    svc = loop.run_until_complete(
        Generator.options(replicas=1).as_service(str(TINY_MODEL_DIR), engine_args=dict(max_model_len=128))
    )
    yield loop, svc
    loop.run_until_complete(ctx.__aexit__(None, None, None))
    loop.close()


def test_vllm_logprobs_match_hf_log_softmax(generator, hf_model):
    loop, svc = generator
    completions = loop.run_until_complete(svc.generate.route(PROMPT, n=8, temperature=1.0, max_tokens=12))
    assert len(completions) == 8
    gaps = []
    for c in completions:
        assert c.finish_reason in ("stop", "length") and (c.policy_versions == 0).all()
        ids = torch.cat([c.prompt_ids, c.response_ids])[None]
        with torch.no_grad():
            logp = torch.log_softmax(hf_model(ids).logits[0], dim=-1)
        P = len(c.prompt_ids)
        ref = logp[P - 1 : -1].gather(-1, c.response_ids[:, None])[:, 0]
        gaps.append((ref - c.logprobs).abs().max().item())
    assert max(gaps) < 1e-4


def test_generator_rejects_bad_input_and_keeps_serving(generator):
    from monarch.actor import ActorError

    loop, svc = generator
    cases = [
        (("",), dict(n=2), "prompt is empty"),
        ((PROMPT,), dict(n=0), "n must be >= 1"),
        (("x" * 200,), dict(n=1), "max_model_len is 128"),
        ((PROMPT,), dict(n=1, max_tokens=120), "exceeds the engine's max_model_len=128"),
    ]
    for args, kwargs, message in cases:
        with pytest.raises(ActorError, match=message):
            loop.run_until_complete(svc.generate.route(*args, **kwargs))
    token_ids = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)(PROMPT)["input_ids"]
    again = loop.run_until_complete(svc.generate.route(token_ids, n=2, max_tokens=4))
    assert len(again) == 2 and all(len(c.response_ids) <= 4 for c in again)
    assert svc.service_stats.retries == 0 and svc.healthy_replicas == 1


def test_concurrent_generate_calls_share_the_engine(generator):
    loop, svc = generator

    async def many():
        return await asyncio.gather(*(svc.generate.route(PROMPT, n=2, max_tokens=16, ignore_eos=True) for _ in range(8)))

    groups = loop.run_until_complete(many())
    assert [len(g) for g in groups] == [2] * 8
    stats = loop.run_until_complete(svc.stats.route())
    assert stats["max_concurrent_requests"] >= 4  # calls overlap in the engine instead of queueing in the actor


def test_trainer_logprobs_equal_generator_behaviour_logprobs(generator):
    from forge_rl.actors.trainer import Trainer, TrainerConfig
    from forge_rl.controller import stop_actor
    from forge_rl.types import Episode, TrainBatch

    loop, svc = generator
    completions = loop.run_until_complete(svc.generate.route(PROMPT, n=8, temperature=1.0, max_tokens=12))
    batch = TrainBatch.collate([Episode(c, advantage=0.0) for c in completions], pad_id=0)
    trainer = loop.run_until_complete(Trainer.options(spmd=True).as_actor(TrainerConfig(model=str(TINY_MODEL_DIR))))
    ours = loop.run_until_complete(trainer.logprobs.call_one(batch))
    loop.run_until_complete(stop_actor(trainer))
    gap = (ours - batch.behaviour_logprobs)[batch.response_mask].abs().max().item()
    assert gap < 1e-4
