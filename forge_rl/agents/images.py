"""OpenAI image content parts on the endpoint's /v1/chat/completions, for a vision-language model.

    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}},
                                 {"type": "text", "text": "Add the two digits."}]}

`take_images` turns each `image_url` part into the model's own image placeholder as text (what its chat template
writes for an image part: `<image>` for Idefics3, `<|vision_start|><|image_pad|><|vision_end|>` for Qwen-VL), so the
rest of the endpoint renders, records and continues the conversation as text, and returns the images, in the order
of their placeholders, for the generate call (`Generator.generate(images=...)`). A later call of the same
conversation sends its earlier images again, as OpenAI clients do, and they are given again with its prompt.

Refused, each in one line before the engine sees the call: an image part given to a text-only model, a URL that is
not a `data:` URL (the endpoint fetches nothing), base64 that does not decode, and an image forge_rl's image checks
refuse (forge_rl/data/images.py: a format the processors do not take, more pixels than the model's processor's
limit).
"""

import base64
import binascii
from typing import Any

from forge_rl.agents.requests import refuse
from forge_rl.data.images import load_image, model_max_pixels
from forge_rl.data.vision import is_vision_model
from forge_rl.errors import DataError

IMAGE_PART = "image_url"
_SIDES = ("\x00forge-rl-before\x00", "\x00forge-rl-after\x00")


class ImageParts:
    """What the endpoint needs of its model to take image parts: its placeholder text (None: a text-only model)
    and its processor's pixel limit."""

    def __init__(self, tokenizer):
        model_dir = getattr(tokenizer, "name_or_path", "") or ""
        self.model = model_dir
        vision = bool(model_dir) and is_vision_model(model_dir)
        self.placeholder = image_placeholder(tokenizer) if vision else None
        self.max_pixels = model_max_pixels(model_dir) if vision else 0

    def take(self, messages: list) -> tuple[list, list[bytes]]:
        """`messages` with each image part made its placeholder text, and the images' bytes in order."""
        images: list[bytes] = []
        out = []
        for i, message in enumerate(messages):
            content = message.get("content") if isinstance(message, dict) else None
            if not isinstance(content, list) or not any(_is_image(p) for p in content):
                out.append(message)
                continue
            parts = []
            for j, part in enumerate(content):
                if not _is_image(part):
                    parts.append(part)
                    continue
                where = f"messages[{i}].content[{j}]"
                if self.placeholder is None:
                    refuse(f"{where}: an image_url part, but the model {self.model} is text-only; send text only")
                images.append(self._image(part, where))
                parts.append({"type": "text", "text": self.placeholder})
            out.append({**message, "content": parts})
        return out, images

    def _image(self, part: dict, where: str) -> bytes:
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
        if not isinstance(url, str) or not url.startswith("data:"):
            refuse(
                f"{where}: image_url {str(url)[:60]!r} is not a data: URL (the endpoint fetches nothing); send the "
                "image inline (data:image/png;base64,...)"
            )
        header, _, payload = url.partition(",")
        if not header.endswith(";base64"):
            refuse(f"{where}: image_url's data: URL is not base64 ({header[:60]!r}); send data:image/png;base64,...")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            refuse(f"{where}: image_url's base64 does not decode")
        try:
            load_image(data, where, self.max_pixels)  # format, size and decoding checked here, not in the engine
        except DataError as e:  # one line naming the part
            refuse(str(e))
        return data


def _is_image(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == IMAGE_PART


def image_placeholder(tokenizer) -> str:
    """The text the model's chat template writes for one image part, found by rendering one between two markers."""
    content = [{"type": "text", "text": _SIDES[0]}, {"type": "image"}, {"type": "text", "text": _SIDES[1]}]
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False)
    return text.split(_SIDES[0], 1)[1].split(_SIDES[1], 1)[0]
