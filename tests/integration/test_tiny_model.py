"""The embedded tiny model: reproducible build, the same model in transformers and TorchTitan (vLLM: test_generator)."""

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
    assert len(ids) == len("user\n12+34=\nassistant\n") + 3  # one id per char, specials are single ids
    assert tok.decode(ids) == text and tok.eos_token_id == 2 and tok.pad_token_id == 0


def test_hf_and_torchtitan_logits_match(hf_model):
    from forge_rl.models.qwen3 import build_model

    titan, _ = build_model(TINY_MODEL_DIR)
    assert sum(p.numel() for p in titan.parameters()) == sum(p.numel() for p in hf_model.parameters())
    tokens = torch.randint(3, 99, (3, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        gap = (titan(tokens) - hf_model(tokens).logits).abs().max().item()
    assert gap < 1e-4


def test_layers_share_one_rope_cache_and_logits_are_unchanged(hf_model):
    """build_model (and the trainer's build) keeps one RoPE cache for all layers: TorchTitan makes one per layer,
    all equal (Qwen3-32B: 64 x 42 MB per rank). The shared cache gives the same logits as transformers."""
    from torchtitan.models.common.rope import RoPE

    from forge_rl.models.qwen3 import build_model, share_rope_caches

    titan, _ = build_model(TINY_MODEL_DIR)
    caches = [m.cache for m in titan.modules() if isinstance(m, RoPE)]
    assert len(caches) == 4 and all(c is caches[0] for c in caches)
    assert share_rope_caches(titan) == 0  # already shared
    tokens = torch.randint(3, 99, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (titan(tokens) - hf_model(tokens).logits).abs().max().item() < 1e-4


def test_model_path_errors_name_the_path(tmp_path):
    assert resolve_model_path("tiny") == str(TINY_MODEL_DIR)
    with pytest.raises(FileNotFoundError, match=f"{tmp_path}.*config.json"):
        resolve_model_path(str(tmp_path))
