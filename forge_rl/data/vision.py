"""Image prompts: where a row's images go in its chat messages, the model's processor that renders them, and the
checks that refuse a prompt the engine could not take, before any engine starts.

A row's text marks where its images go with IMAGE_MARKER ("What is <image> plus <image>?"); a text without
markers gets its images at the start of the first user turn. `with_images` turns the messages into the content
parts every vision-language chat template takes (`{"type": "image"}`, `{"type": "text", "text": ...}`), and
`render_image_prompt` renders them with the model's processor (its chat template writes the model's own image
placeholder: `<image>` for Idefics3, `<|vision_start|><|image_pad|><|vision_end|>` for Qwen-VL), one per image,
which the engine expands to the image's tokens.

Refused, each in one line: a model without a vision tower given images (`check_vision_model`); more markers or
placeholders than images, or fewer (`with_images`, `check_placeholders`).
"""

import functools
import json
from pathlib import Path
from typing import Any

from forge_rl.errors import ConfigError, DataError

IMAGE_MARKER = "<image>"


def model_config(model_dir: str | Path) -> dict:
    """The model directory's config.json (empty when it has none: the caller's own checks say what is missing)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def is_vision_model(model_dir: str | Path) -> bool:
    """Whether the model has a vision tower (HF configs of vision-language models carry a `vision_config`)."""
    return _has_vision_config(str(model_dir))


@functools.lru_cache(maxsize=16)  # asked once per prompt rendered (forge_rl/data/task.py: render)
def _has_vision_config(model_dir: str) -> bool:
    return "vision_config" in model_config(model_dir)


def image_token_id(config: dict) -> int | None:
    """The token id the model's prompts hold once per image before the engine expands it (None: text-only)."""
    for key in ("image_token_id", "image_token_index"):
        if isinstance(config.get(key), int):
            return config[key]
    return None


def check_vision_model(model_dir: str | Path, key: str = "model") -> None:
    """A ConfigError when the model at `model_dir` (config key `key`) cannot take images."""
    if not is_vision_model(model_dir):
        raise ConfigError(
            f"{key}={str(model_dir)!r} is a text-only model (its config.json has no vision_config), but the prompts "
            "have images; give a vision-language model (e.g. tiny-vlm), or drop the image column"
        )


def load_processor(model_dir: str | Path, key: str = "model"):
    """The model's transformers processor (tokenizer, image processor, chat template); a ConfigError for a
    text-only model or a directory without the processor's files."""
    from forge_rl.deps.transformers import auto_processor

    check_vision_model(model_dir, key)
    try:
        processor = auto_processor(model_dir)
    except (OSError, ValueError, KeyError, TypeError, ImportError) as e:
        why = " ".join(str(e).split())[:200]
        raise ConfigError(
            f"{key}: no processor transformers can load in {model_dir} ({type(e).__name__}: {why})"
        ) from None
    if getattr(processor, "image_processor", None) is None:
        raise ConfigError(f"{key}: the processor in {model_dir} has no image processor ({type(processor).__name__})")
    return processor


def with_images(messages: list[dict], n_images: int, where: str) -> list[dict]:
    """`messages` (string contents) with IMAGE_MARKER turned into image parts; without markers, the images start
    the first user turn. Refuses a marker count that is not the number of images."""
    markers = sum(m["content"].count(IMAGE_MARKER) for m in messages if isinstance(m.get("content"), str))
    if markers > n_images:
        raise DataError(f"{where}: {markers} image placeholders ({IMAGE_MARKER}) but {n_images} images")
    if 0 < markers < n_images:
        raise DataError(f"{where}: {n_images} images but only {markers} image placeholders ({IMAGE_MARKER})")
    out, placed = [], markers > 0
    for message in messages:
        content = message["content"]
        if not isinstance(content, str):
            out.append(message)
            continue
        parts: list[dict[str, Any]] = []
        if not placed and message["role"] == "user":
            parts, placed = [{"type": "image"} for _ in range(n_images)], True
        for i, piece in enumerate(content.split(IMAGE_MARKER)):
            if i:
                parts.append({"type": "image"})
            if piece:
                parts.append({"type": "text", "text": piece})
        out.append({**message, "content": parts})
    if not placed and n_images:
        raise DataError(f"{where}: {n_images} images but no user turn to put them in")
    return out


def render_image_prompt(processor, messages: list[dict], n_images: int, where: str) -> str:
    """The prompt text of `messages` (content parts, from `with_images`) by the processor's chat template, checked
    to hold one image placeholder per image."""
    template = getattr(processor, "chat_template", None) or getattr(processor.tokenizer, "chat_template", None)
    if not template:
        raise DataError(f"{where}: the model's processor has no chat template to place its image tokens")
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, chat_template=template)
    check_placeholders(text, n_images, processor, where)
    return text


def image_args(example) -> dict[str, Any]:
    """The `Generator.generate` keyword argument that gives a task example's images with its prompt (`images`),
    or none for a text example."""
    images = getattr(example, "images", ())
    return {"images": list(images)} if images else {}


def check_placeholders(text: str, n_images: int, processor, where: str) -> None:
    """A DataError when the rendered prompt holds more (or fewer) of the model's image tokens than images."""
    token = getattr(processor, "image_token", None)
    if token is None:
        return
    found = text.count(token)
    if found != n_images:
        more = "more" if found > n_images else "fewer"
        raise DataError(
            f"{where}: the prompt holds {found} image placeholders ({token}), {more} than its {n_images} images"
        )
