"""Build the embedded tiny model: a ~0.8M-parameter Qwen3 with a character-level tokenizer.

    python -m forge_rl.models.build_tiny [--out forge_rl/models/tiny]

The output is an ordinary Hugging Face model directory (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json, generation_config.json) that transformers, vLLM and
TorchTitan's Qwen3 state-dict adapter all load. Everything is derived from a fixed seed, so
re-running the script reproduces the shipped files bit for bit (tests/integration/test_tiny_model.py checks).
"""

import argparse
import json
from pathlib import Path

import torch

DEFAULT_OUT = Path(__file__).parent / "tiny"
SEED = 0

# The special tokens come first so their ids are stable: 0 pads, 1/2 delimit chat turns.
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# One token per printable ASCII character plus newline: enough for arithmetic, code and chat.
CHARS = ["\n"] + [chr(c) for c in range(32, 127)]
VOCAB_SIZE = 128  # 3 special + 96 chars, padded with reserved tokens to a round size.

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

MODEL_CONFIG = dict(
    architectures=["Qwen3ForCausalLM"],
    model_type="qwen3",
    vocab_size=VOCAB_SIZE,
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    hidden_act="silu",
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    tie_word_embeddings=True,
    attention_bias=False,
    attention_dropout=0.0,
    initializer_range=0.02,
    use_cache=True,
    bos_token_id=None,
    eos_token_id=2,
    pad_token_id=0,
    torch_dtype="float32",
)


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in CHARS:
        vocab[ch] = len(vocab)
    for i in range(len(vocab), VOCAB_SIZE):
        vocab[f"<|reserved_{i}|>"] = i
    # A BPE without merges and without a pre-tokenizer is exactly "one token per character".
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(
        SPECIAL_TOKENS + [f"<|reserved_{i}|>" for i in range(len(SPECIAL_TOKENS) + len(CHARS), VOCAB_SIZE)]
    )
    return tokenizer


def build(out: Path, **config_overrides) -> Path:
    """Write the tiny model to `out`. `config_overrides` (HF Qwen3 config keys, e.g. hidden_size=768)
    make a larger char-level model with random weights for benchmarks."""
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            dict(
                tokenizer_class="PreTrainedTokenizerFast",
                bos_token=None,
                eos_token="<|im_end|>",
                pad_token="<|endoftext|>",
                unk_token=None,
                model_max_length=MODEL_CONFIG["max_position_embeddings"],
                clean_up_tokenization_spaces=False,
                chat_template=CHAT_TEMPLATE,
            ),
            indent=2,
        )
        + "\n"
    )
    return save_random_model(out, {**MODEL_CONFIG, **config_overrides}, dict(eos_token_id=2, pad_token_id=0))


def save_random_model(out: Path, config: dict, generation_config: dict, seed: int = SEED) -> Path:
    """Write config.json, generation_config.json and model.safetensors of a Qwen3 with random weights from
    `seed` (HF Qwen3 config keys) to `out`; the tokenizer files are the caller's (e.g. tests/support/qwen3_fixture.py:
    Qwen3's real vocabulary on a small random model)."""
    from safetensors.torch import save_file
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(generation_config, indent=2) + "\n")
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(**config)).float()
    # Save the tied lm_head explicitly: vLLM's weight reload path expects it (docs/stack.md).
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    from safetensors.torch import load_file

    out = build(parser.parse_args().out)
    n = sum(t.numel() for name, t in load_file(str(out / "model.safetensors")).items() if name != "lm_head.weight")
    print(f"wrote {out} ({n:,} parameters; lm_head.weight is stored too but tied to the embeddings)")


if __name__ == "__main__":
    main()
