"""What a rehearsal of a vision-language trainer adds to a text one: the model's shape with its vision tower, a sparse
checkpoint holding the tower's and the connector's tensors under their HF names, the processor's files, and train
rows that carry an image whose tokens the tower embeds.

    cfg = vision_hf_config(VISION_SHAPES["SmolVLM-Instruct"], layers=4)    # an Idefics3 config.json
    write_sparse_checkpoint(model_dir, cfg)   # text + tower + connector tensors, and (write_processor_files) the
                                              # image processor the trainer loads

The tower's tensor names and shapes come from transformers' own modules built on the meta device, so they are the
ones a real checkpoint of that config holds.
"""

import copy
import json
import shutil
from pathlib import Path

import torch

from forge_rl.models.vision_language import HF_PREFIXES

# A published checkpoint's shape: SmolVLM-Instruct (Idefics3): SigLIP so400m/14 at 384 px before SmolLM2-1.7B,
# a 3x3 pixel shuffle (81 tokens a 384-pixel tile)
VISION_SHAPES = {
    "SmolVLM-Instruct": dict(
        architectures=["Idefics3ForConditionalGeneration"],
        model_type="idefics3",
        image_token_id=49153,
        scale_factor=3,
        tie_word_embeddings=False,
        text_config=dict(
            model_type="llama",
            vocab_size=49155,
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=24,
            num_attention_heads=32,
            num_key_value_heads=32,
            head_dim=64,
            hidden_act="silu",
            max_position_embeddings=16384,
            rms_norm_eps=1e-5,
            rope_parameters=dict(rope_type="default", rope_theta=273768.0),
            attention_bias=False,
            tie_word_embeddings=False,
            eos_token_id=2,
            pad_token_id=0,
        ),
        vision_config=dict(
            hidden_size=1152,
            intermediate_size=4304,
            num_hidden_layers=27,
            num_attention_heads=16,
            image_size=384,
            patch_size=14,
            num_channels=3,
        ),
    )
}
TINY_VLM = Path(__file__).parents[1] / "models" / "tiny_vlm"  # its tokenizer and chat template serve any shape
PROCESSOR_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def vision_hf_config(shape: dict, layers: int | None = None) -> dict:
    """The Idefics3 config.json of `shape` (a VISION_SHAPES entry), its language model with `layers` layers if given."""
    cfg = copy.deepcopy(shape)
    if layers:
        cfg["text_config"]["num_hidden_layers"] = layers
    return cfg


def vision_checkpoint_tensors(cfg: dict, text_tensors) -> dict[str, tuple[int, ...]]:
    """The HF tensor names and shapes of the Idefics3 checkpoint of `cfg`: its language model's as
    `text_tensors(text config)` names them (a decoder's, under `model.`) moved under `model.text_model.`, less the
    per-head q/k norms a Llama has not; the vision tower's and the connector's from transformers' modules."""
    from forge_rl.deps.transformers import idefics3_vision_modules
    from forge_rl.models.vision_language import text_config

    out = {}
    for name, shape in text_tensors(text_config(cfg)).items():
        if name.endswith(("q_norm.weight", "k_norm.weight")):
            continue
        out["model.text_model." + name[len("model.") :] if name.startswith("model.") else name] = shape
    with torch.device("meta"):
        tower, connector = idefics3_vision_modules(cfg)
    hf_prefix = {ours: hf for hf, ours in HF_PREFIXES.items()}
    for part, module in (("vision.vision_model.", tower), ("vision.connector.", connector)):
        out |= {hf_prefix[part] + name: tuple(p.shape) for name, p in module.named_parameters()}
    return out


def write_processor_files(model_dir: Path, cfg: dict) -> None:
    """The processor's files beside the sparse checkpoint: the image processor (what the trainer makes pixels with)
    as SmolVLM's resizes, to 4 tiles on the longest edge, cut into tiles of the tower's size plus the whole image;
    tiny-vlm's tokenizer and chat template (the rehearsal's token ids are drawn, not tokenised)."""
    tile = cfg["vision_config"]["image_size"]
    image_seq_len = (cfg["vision_config"]["image_size"] // cfg["vision_config"]["patch_size"]) ** 2
    image_seq_len //= cfg["scale_factor"] ** 2
    for name in PROCESSOR_FILES:
        shutil.copy(TINY_VLM / name, model_dir / name)
    processor = json.loads((TINY_VLM / "preprocessor_config.json").read_text())
    processor |= dict(size={"longest_edge": 4 * tile}, max_image_size={"longest_edge": tile}, do_image_splitting=True)
    (model_dir / "preprocessor_config.json").write_text(json.dumps(processor, indent=2))
    (model_dir / "processor_config.json").write_text(
        json.dumps({"processor_class": "Idefics3Processor", "image_seq_len": image_seq_len}, indent=2)
    )


def frozen_hf_prefixes(freeze: list[str]) -> list[str]:
    """The HF name prefixes of trainer.freeze's parts of a vision-language model (a push leaves them out):
    `vision` is the tower and the connector, `vision.vision_model` the tower alone."""
    out = []
    for hf, ours in HF_PREFIXES.items():
        for name in freeze:
            part = name + "."
            if ours.startswith(part):
                out.append(hf)
            elif part.startswith(ours):
                out.append(hf + part[len(ours) :])
    return out


def image_row(tower, image_processor, rng) -> tuple[bytes, int]:
    """One row's image (PNG bytes of a square noise image of the tower's tile size) and how many image tokens the
    processor and the tower make of it (its tiles, the whole image included, times the tokens a tile)."""
    import io

    import numpy as np
    from PIL import Image

    side = int(image_processor.max_image_size["longest_edge"])
    pixels = rng.integers(0, 256, (side, side, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    tiles = image_processor([[Image.fromarray(pixels)]], return_tensors="np")["pixel_values"].shape[1]
    return buffer.getvalue(), tiles * tower.tokens_per_tile
