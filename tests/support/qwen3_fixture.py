"""Qwen3's real tokenizer (tests/support/fixtures/qwen3: vocab.json, merges.txt, tokenizer_config.json with the
real chat
template; SOURCE.md says where they come from) on a small random-init Qwen3 with the real 151,936-entry vocabulary,
built once per test session into a temporary directory. Offline: nothing is downloaded. (head_dim 32: vLLM's CPU
attention has no kernel for 16.)"""

import shutil
from pathlib import Path

import pytest

from forge_rl.models.build_tiny import MODEL_CONFIG, save_random_model

FIXTURE = Path(__file__).parent / "fixtures" / "qwen3"
TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer_config.json")
IM_END, ENDOFTEXT = 151645, 151643
THINK_TOKENS = [151667, 151668]  # <think>, </think>
CONFIG = {
    **MODEL_CONFIG,
    "vocab_size": 151_936,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 512,
    "tie_word_embeddings": True,
    "bos_token_id": ENDOFTEXT,
    "eos_token_id": IM_END,
    "pad_token_id": ENDOFTEXT,
}


def qwen3_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(FIXTURE, local_files_only=True)


def build_qwen3_model(out: Path) -> Path:
    """A Hugging Face model directory: the fixture's tokenizer files, config.json, generation_config.json and
    model.safetensors (lm_head.weight included though tied) of a ~10M-parameter random Qwen3 (seed 0)."""
    save_random_model(out, CONFIG, {"eos_token_id": IM_END, "pad_token_id": ENDOFTEXT})
    keep_the_model_from_thinking(out / "model.safetensors")
    for name in TOKENIZER_FILES:
        shutil.copy(FIXTURE / name, out / name)
    return out


def keep_the_model_from_thinking(weights: Path) -> None:
    """Embeddings (tied to the output) scaled up, so the random model's next-token distribution is peaked, and
    the rows of <think> and </think> zeroed, so they never come near the top: a reply containing </think> is one
    Qwen3's template rewrites when a user turn follows it (refused, tests/integration/test_qwen3_template.py), and
    a random
    model over the full vocabulary does sample it now and then."""
    from safetensors.torch import load_file, save_file

    state = load_file(str(weights))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        state[name] = state[name] * 25
        state[name][THINK_TOKENS] = 0
    save_file(state, str(weights), metadata={"format": "pt"})


@pytest.fixture(scope="session")
def qwen3_model_dir(tmp_path_factory) -> Path:
    return build_qwen3_model(tmp_path_factory.mktemp("qwen3-random") / "model")
