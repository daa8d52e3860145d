"""Build the embedded tiny vision-language model `tiny-vlm`: an Idefics3 (SmolVLM's architecture) of the tiny
model's size, with random weights.

    python -m forge_rl.models.build_tiny_vlm [--out forge_rl/models/tiny_vlm]

An HF `Idefics3ForConditionalGeneration` directory that transformers (`AutoProcessor`, the model) and vLLM load:

- a SigLIP-style vision tower (2 layers, width 64) over 8x8 patches of a 64x64 image, whose 64 patch embeddings a
  pixel shuffle (scale 2) and a linear connector turn into IMAGE_TOKENS language-model inputs;
- a Llama language model of the tiny model's shape (4 layers, width 128) on the tiny model's character-level
  vocabulary, four of its reserved tokens renamed to the processor's image tokens (`<image>`,
  `<fake_token_around_image>`, `<global-img>`, `<end_of_utterance>`);
- the processor's files: preprocessor_config.json (resize to 64 pixels on the longest edge, no tiling),
  processor_config.json (IMAGE_TOKENS per image) and a chat template whose `{"type": "image"}` content part is an
  `<image>` placeholder, which the processor (or vLLM) expands.

Why Idefics3 and not Qwen2.5-VL or Qwen3-VL (docs/vision.md): vLLM 0.32's Qwen-VL modules import transformers'
torchvision image processors when they are imported, and the CPU stack has no torchvision (PyPI's builds link
CUDA's libtorch, so setup removes them). Idefics3's processor has a PIL backend and no video processor.

Everything comes from a fixed seed: re-running the script reproduces the shipped files bit for bit.
"""

import argparse
import json
from pathlib import Path

import torch

from forge_rl.models.build_tiny import MODEL_CONFIG, build_tokenizer

DEFAULT_OUT = Path(__file__).parent / "tiny_vlm"
SEED = 0
IMAGE_SIZE = 64  # the longest edge every image is resized to
PATCH_SIZE = 8
SCALE_FACTOR = 2  # pixel shuffle: SCALE_FACTOR**2 patches make one language-model token
IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2 // SCALE_FACTOR**2
# reserved ids of the tiny vocabulary that become the processor's tokens (ids stay put)
IMAGE_SPECIAL_TOKENS = {99: "<fake_token_around_image>", 100: "<image>", 101: "<global-img>", 102: "<end_of_utterance>"}
IMAGE_TOKEN_ID = 100

# The tiny model's template, with list content: text parts as they are, an image part as the `<image>` placeholder.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

VISION_CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    image_size=IMAGE_SIZE,
    patch_size=PATCH_SIZE,
    num_channels=3,
)

TEXT_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_parameters",
    "attention_bias",
    "initializer_range",
    "eos_token_id",
    "pad_token_id",
)


def model_config() -> dict:
    """The HF Idefics3 config: the vision tower above and a Llama text model of the tiny Qwen3's shape."""
    text = {key: MODEL_CONFIG[key] for key in TEXT_KEYS}
    return dict(
        architectures=["Idefics3ForConditionalGeneration"],
        model_type="idefics3",
        text_config=dict(model_type="llama", tie_word_embeddings=True, **text),
        vision_config=VISION_CONFIG,
        image_token_id=IMAGE_TOKEN_ID,
        scale_factor=SCALE_FACTOR,
        tie_word_embeddings=True,
        eos_token_id=MODEL_CONFIG["eos_token_id"],
        pad_token_id=MODEL_CONFIG["pad_token_id"],
        torch_dtype="float32",
    )


def processor_files() -> dict[str, dict]:
    """preprocessor_config.json (the image processor) and processor_config.json (the processor's own settings)."""
    preprocessor = dict(
        image_processor_type="Idefics3ImageProcessor",
        processor_class="Idefics3Processor",
        do_convert_rgb=True,
        do_resize=True,
        size={"longest_edge": IMAGE_SIZE},
        max_image_size={"longest_edge": IMAGE_SIZE},
        do_image_splitting=False,  # one global image per input: IMAGE_TOKENS tokens each, whatever its size
        resample=1,
        do_rescale=True,
        rescale_factor=1 / 255,
        do_normalize=True,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
        do_pad=True,
    )
    return {
        "preprocessor_config.json": preprocessor,
        "processor_config.json": dict(processor_class="Idefics3Processor", image_seq_len=IMAGE_TOKENS),
    }


def write_tokenizer(out: Path) -> None:
    """The tiny model's tokenizer with the image tokens named, its config naming the processor and template."""
    tokenizer = json.loads(build_tokenizer().to_str())
    for token in tokenizer["added_tokens"]:
        token["content"] = IMAGE_SPECIAL_TOKENS.get(token["id"], token["content"])
    vocab = tokenizer["model"]["vocab"]
    for name, index in list(vocab.items()):
        if index in IMAGE_SPECIAL_TOKENS:
            del vocab[name]
            vocab[IMAGE_SPECIAL_TOKENS[index]] = index
    (out / "tokenizer.json").write_text(json.dumps(tokenizer, indent=2) + "\n")
    config = dict(
        tokenizer_class="PreTrainedTokenizerFast",
        processor_class="Idefics3Processor",
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        model_max_length=MODEL_CONFIG["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
    )
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)  # where a processor looks for its template


def build(out: Path = DEFAULT_OUT) -> Path:
    """Write tiny-vlm to `out`: tokenizer and processor files, config and random weights from SEED."""
    from safetensors.torch import save_file
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration

    out.mkdir(parents=True, exist_ok=True)
    write_tokenizer(out)
    for name, content in processor_files().items():
        (out / name).write_text(json.dumps(content, indent=2) + "\n")
    config = model_config()
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = dict(eos_token_id=MODEL_CONFIG["eos_token_id"], pad_token_id=MODEL_CONFIG["pad_token_id"])
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    torch.manual_seed(SEED)
    model = Idefics3ForConditionalGeneration(Idefics3Config(**config)).float()
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    from safetensors.torch import load_file

    out = build(parser.parse_args().out)
    tensors = load_file(str(out / "model.safetensors"))
    vision = sum(t.numel() for name, t in tensors.items() if "vision" in name or "connector" in name)
    total = sum(t.numel() for t in tensors.values())
    print(f"wrote {out} ({total:,} parameters, {vision:,} of them the vision tower and connector)")


if __name__ == "__main__":
    main()
