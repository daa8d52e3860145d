"""A vision-language model in the trainer: TorchTitan's decoder for the language model, with the checkpoint's vision
tower and connector (transformers' own modules) in front of its token embedding.

    config = titan_config(model_dir)                 # the language model's TorchTitan config
    module = config.build(); attach_vision(module, read_hf_config(model_dir))
    adapter = VisionLanguageAdapter(Qwen3StateDictAdapter(config, model_dir))   # HF names <-> the module's
    images = image_pixels(image_processor, rows_images)    # each distinct image once
    module.vision.show(images, feature_map(tokens, images, module.vision))   # the next forward's images
    logits = module(tokens)        # each image token's embedding replaced by its image's features, in order

Idefics3 (SmolVLM's architecture; the embedded tiny-vlm): its language model is a Llama, which is TorchTitan's
Qwen3 decoder without the per-head q/k norms (the same weight names and the same rotary convention), so the
trainer's whole text path (FSDP2, the fused head, the losses, the weight push) serves it unchanged. The vision
tower and connector are transformers' `Idefics3VisionTransformer` and `Idefics3Connector`, loaded from the same
checkpoint; their features replace the image tokens' embeddings in a forward hook on the token embedding, so the
decoder's forward and its parallelisation are TorchTitan's own. The engine (vLLM) expands each image placeholder
into the image's tokens; the trainer scores those same ids with the same pixels (docs/vision.md).
"""

from dataclasses import dataclass
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
        patches = (int(hf["vision_config"]["image_size"]) // self.patch_size) ** 2
        self.tokens_per_tile = patches // int(hf.get("scale_factor", 1)) ** 2  # the connector's pixel shuffle
        self.pending: tuple[ImageBatch, torch.Tensor] | None = None

    def show(self, images: "ImageBatch | None", feature_at: torch.Tensor | None = None) -> None:
        """The next forward's images (None: none) and, for each of its token places, the row of their features
        (flattened over tiles and tokens) that embeds it, -1 where the token's own embedding stays
        (`feature_map`; packed with the forward's rows when they are)."""
        self.pending = None if images is None else (images, feature_at)

    def forward(self, pixel_values: torch.Tensor, pixel_attention_mask: torch.Tensor) -> torch.Tensor:
        """[N, image tokens, language width]: the features of N images (tiles), as Idefics3 computes them: a patch
        counts when any of its pixels is the image's (not the processor's padding)."""
        p = self.patch_size
        patches = pixel_attention_mask.unfold(1, p, p).unfold(2, p, p)
        patch_mask = patches.sum(dim=(-1, -2)) > 0
        hidden = self.vision_model(pixel_values=pixel_values, patch_attention_mask=patch_mask).last_hidden_state
        return self.connector(hidden)

    def embed_images(self, tokens: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
        """`embeddings` of `tokens` with the shown images' features at the places `show` named."""
        if self.pending is None:
            return embeddings
        images, feature_at = self.pending
        if feature_at.shape != tokens.shape:
            raise ValueError(f"the images' feature map is {tuple(feature_at.shape)} for tokens {tuple(tokens.shape)}")
        weight = self.connector.modality_projection.proj.weight
        features = self(images.pixels.to(weight.device, weight.dtype), images.attention_mask.to(weight.device))
        at = feature_at.to(embeddings.device)
        where = at >= 0
        picked = features.flatten(0, 1)[at[where]]
        return embeddings.masked_scatter(where[..., None], picked.to(embeddings.dtype))


def attach_vision(module: torch.nn.Module, hf: dict) -> VisionTower:
    """Give TorchTitan's decoder `module` the checkpoint's vision tower (as `module.vision`, built on the current
    device: the meta device before parallelising) and the hook that puts its features into the token embedding."""
    tower = module.vision = VisionTower(hf)

    def hook(_embedding, args, output):
        return tower.embed_images(args[0], output)

    module.tok_embeddings.register_forward_hook(hook)
    return tower


def shard_vision_layers(tower: VisionTower, mesh, param_dtype: torch.dtype) -> None:
    """FSDP2 over each of the tower's encoder layers, as TorchTitan shards each decoder layer, before the decoder is
    parallelised: a step then gathers one tower layer at a time. Left to the decoder's root unit, the whole tower
    would be gathered for the forward and kept through the backward."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
    for layer in tower.vision_model.encoder.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)


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


@dataclass
class ImageBatch:
    """A batch's images as the vision tower takes them: each distinct image once."""

    pixels: torch.Tensor  # [N, 3, H, W]: every distinct image's tiles, in the order first seen
    attention_mask: torch.Tensor  # [N, H, W]: which pixels are the image's (not the processor's padding)
    spans: list[tuple[int, int]]  # each image of the rows, rows in order: its tiles' [start, end) in `pixels`


def image_pixels(image_processor, rows_images: list[tuple[bytes, ...]]) -> ImageBatch | None:
    """The pixels of the images of `rows_images` (each row's encoded images, in the order of its image tokens), as
    the model's image processor makes them for the engine; None: no images. A group's G rows carry one image,
    which is decoded, processed and encoded once."""
    from forge_rl.data.images import load_image

    distinct: dict[bytes, int] = {}
    order = [distinct.setdefault(image, len(distinct)) for row in rows_images for image in row]
    if not order:
        return None
    out = image_processor([[load_image(image, "a batch row's image")] for image in distinct], return_tensors="pt")
    pixels, mask = out["pixel_values"], out["pixel_attention_mask"]
    real = pixels.flatten(2).ne(0).any(-1)  # [images, tiles]: the processor pads each image's tiles with zero ones
    ends = real.sum(1).cumsum(0).tolist()
    starts = [0, *ends[:-1]]
    return ImageBatch(pixels[real], mask[real].bool(), [(starts[i], ends[i]) for i in order])


def feature_map(tokens: torch.Tensor, images: ImageBatch | None, tower: VisionTower, sampled=None) -> torch.Tensor:
    """[B, T]: for each image token of `tokens`, the row of the images' flattened features that embeds it (each row's
    images fill its image tokens in order), -1 for every other token. `sampled` [B, T]: the tokens the model
    sampled, whose image-token ids are text (the engine embeds a sampled id as text; only the placeholders it
    expanded are images). A count the images do not make is an error naming both."""
    at = tokens == tower.image_token_id
    if sampled is not None:
        at &= ~sampled.to(at.device).bool()
    out = torch.full_like(tokens, -1)
    if images is None:
        if at.any():
            raise ValueError(f"{int(at.sum())} image tokens in the batch and no images shown to the vision tower")
        return out
    k = tower.tokens_per_tile
    index = torch.cat([torch.arange(start * k, end * k) for start, end in images.spans])
    if len(index) != int(at.sum()):
        raise ValueError(
            f"the batch has {int(at.sum())} image tokens and its {len(images.spans)} images make {len(index)}: "
            "the rows' ids are not the engine's expansion of them"
        )
    out[at] = index
    return out
