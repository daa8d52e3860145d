"""A vision-language model in the trainer: TorchTitan's decoder for the language model, with the checkpoint's vision
tower and connector (transformers' own modules) in front of its token embedding.

    config = titan_config(model_dir)                 # the language model's TorchTitan config
    module = config.build(); attach_vision(module, read_hf_config(model_dir))
    adapter = VisionLanguageAdapter(Qwen3StateDictAdapter(config, model_dir))   # HF names <-> the module's
    module.vision.show(pixel_values, pixel_attention_mask)   # the next forward's images (`image_pixels`)
    logits = module(tokens)        # each image token's embedding replaced by its image's features, in order

Idefics3 (SmolVLM's architecture; the embedded tiny-vlm): its language model is a Llama, which is TorchTitan's
Qwen3 decoder without the per-head q/k norms (the same weight names and the same rotary convention), so the
trainer's whole text path (FSDP2, the fused head, the losses, the weight push) serves it unchanged. The vision
tower and connector are transformers' `Idefics3VisionTransformer` and `Idefics3Connector`, loaded from the same
checkpoint; their features replace the image tokens' embeddings in a forward hook on the token embedding, so the
decoder's forward and its parallelisation are TorchTitan's own. The engine (vLLM) expands each image placeholder
into the image's tokens; the trainer scores those same ids with the same pixels (docs/vision.md).
"""

from pathlib import Path

import torch

# first (through forge_rl/deps/torchtitan.py): TorchTitan's device type "cpu" without an accelerator
from forge_rl.models.qwen3 import dense_config
from forge_rl.models.qwen3_config import read_hf_config

HF_PREFIXES = {"model.vision_model.": "vision.vision_model.", "model.connector.": "vision.connector."}
TEXT_PREFIX = "model.text_model."


def is_vision_language(hf: dict) -> bool:
    return "vision_config" in hf


def text_config(hf: dict) -> dict:
    """The language model's HF config, with the whole model's weight tying (Idefics3 keeps it at the top)."""
    text = dict(hf["text_config"])
    text.setdefault("tie_word_embeddings", hf.get("tie_word_embeddings", False))
    return text


def titan_config(model_dir: str | Path):
    """TorchTitan's config of the language model of the vision-language checkpoint in `model_dir`."""
    text = text_config(read_hf_config(model_dir))
    return dense_config(text, qk_norm=text["model_type"] != "llama")


class VisionTower(torch.nn.Module):
    """The checkpoint's vision encoder and connector (transformers' modules): images' pixels -> one feature row per
    image token. `show` hands it the next forward's images; the token embedding's hook (`attach_vision`) runs it."""

    def __init__(self, hf: dict):
        from forge_rl.deps.transformers import idefics3_vision_modules

        super().__init__()
        self.vision_model, self.connector = idefics3_vision_modules(hf)
        self.image_token_id = int(hf["image_token_id"])
        self.patch_size = int(hf["vision_config"]["patch_size"])
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self.sampled: torch.Tensor | None = None

    def show(
        self,
        pixel_values: torch.Tensor | None,
        pixel_attention_mask: torch.Tensor | None = None,
        sampled: torch.Tensor | None = None,
    ) -> None:
        """The images of the next forward's image tokens, in their order: [N, 3, H, W] and [N, H, W] (None: none).
        `sampled` [B, T]: the tokens the model sampled, whose image-token ids are text (the engine embeds a sampled
        id as text; only the placeholders it expanded are images)."""
        self.pending = None if pixel_values is None else (pixel_values, pixel_attention_mask)
        self.sampled = sampled

    def forward(self, pixel_values: torch.Tensor, pixel_attention_mask: torch.Tensor) -> torch.Tensor:
        """[N, image tokens, language width]: the features of N images (tiles), as Idefics3 computes them: a patch
        counts when any of its pixels is the image's (not the processor's padding)."""
        p = self.patch_size
        patches = pixel_attention_mask.unfold(1, p, p).unfold(2, p, p)
        patch_mask = patches.sum(dim=(-1, -2)) > 0
        hidden = self.vision_model(pixel_values=pixel_values, patch_attention_mask=patch_mask).last_hidden_state
        return self.connector(hidden)

    def embed_images(self, tokens: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
        """`embeddings` of `tokens` with the image tokens' rows replaced by the shown images' features."""
        at = tokens == self.image_token_id
        if self.sampled is not None:
            at &= ~self.sampled.to(at.device)
        if self.pending is None:
            if at.any():
                raise ValueError(f"{int(at.sum())} image tokens in the batch and no images shown to the vision tower")
            return embeddings
        pixels, mask = (t.to(embeddings.device) for t in self.pending)
        features = self(pixels.to(self.connector.modality_projection.proj.weight.dtype), mask)
        if features.shape[0] * features.shape[1] != int(at.sum()):
            raise ValueError(
                f"the batch has {int(at.sum())} image tokens and its {features.shape[0]} images make "
                f"{features.shape[0] * features.shape[1]}: the rows' ids are not the engine's expansion of them"
            )
        return embeddings.masked_scatter(at[..., None], features.to(embeddings.dtype))


def attach_vision(module: torch.nn.Module, hf: dict) -> VisionTower:
    """Give TorchTitan's decoder `module` the checkpoint's vision tower (as `module.vision`, built on the current
    device: the meta device before parallelising) and the hook that puts its features into the token embedding."""
    tower = module.vision = VisionTower(hf)

    def hook(_embedding, args, output):
        return tower.embed_images(args[0], output)

    module.tok_embeddings.register_forward_hook(hook)
    return tower


class VisionLanguageAdapter:
    """The checkpoint's (HF) names <-> the module's: the language model's through TorchTitan's Qwen3 adapter
    (`model.text_model.X` is its `model.X`), the tower's and the connector's under `vision.`."""

    def __init__(self, text_adapter):
        self.text = text_adapter

    def from_hf(self, hf_state: dict) -> dict:
        ours, text = {}, {}
        for name, value in hf_state.items():
            if vision := _renamed(name, HF_PREFIXES):
                ours[vision] = value
            elif name.startswith(TEXT_PREFIX):
                text["model." + name[len(TEXT_PREFIX) :]] = value
            else:
                text[name] = value  # lm_head.weight
        return ours | self.text.from_hf(text)

    def to_hf(self, state: dict) -> dict:
        ours = {hf: v for name, v in state.items() if (hf := _renamed(name, _inverse(HF_PREFIXES)))}
        text = self.text.to_hf({name: v for name, v in state.items() if not name.startswith("vision.")})
        for name, value in text.items():
            ours[TEXT_PREFIX + name[len("model.") :] if name.startswith("model.") else name] = value
        return ours


def _renamed(name: str, prefixes: dict[str, str]) -> str | None:
    for old, new in prefixes.items():
        if name.startswith(old):
            return new + name[len(old) :]
    return None


def _inverse(prefixes: dict[str, str]) -> dict[str, str]:
    return {new: old for old, new in prefixes.items()}


def image_pixels(image_processor, rows_images: list[tuple[bytes, ...]]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The pixels of every image of `rows_images` (each row's encoded images, in the order of its image tokens),
    rows in order, as the model's image processor makes them for the engine: ([N, 3, H, W], [N, H, W]), one entry
    per image (or tile) whose features fill the batch's image tokens in row-major order; None: no images."""
    from forge_rl.data.images import load_image

    images = [[load_image(image, "a batch row's image")] for row in rows_images for image in row]
    if not images:
        return None
    out = image_processor(images, return_tensors="pt")
    pixels, mask = out["pixel_values"], out["pixel_attention_mask"]
    real = pixels.flatten(2).ne(0).any(-1)  # the processor pads each image's tiles with zero ones
    return pixels[real], mask[real].bool()
