"""A multi-turn trajectory's images: the task row's, then those an environment's steps return (`EnvStep.images`).

An environment's step shows its images with IMAGE_MARKER in its messages' text ("Here is the board: <image>"),
or, without markers, at the start of its first user turn, as a task row does (forge_rl/data/vision.py's
`with_images`). Its messages are rendered with the chat template's own image placeholders, which the trajectory
appends as the environment's tokens; the next model turn is generated with every image of the conversation so far,
in order. The engine expands each placeholder to its image's tokens, and the trajectory keeps the engine's ids (the
expanded environment tokens, masked like the rest of the environment's turn), so `prompt_ids + response_ids` is what
the engine ran, and the Completion's `images` are its image tokens' pixels, in order. A text-only model given an
environment's images is refused by the generator in one line (the group is dropped as a generation error), and so
is a next turn after a model turn that sampled the image token itself (more placeholders than images).

An image counts as its placeholder's tokens in `env.max_total_tokens` (the expansion is known once the engine has
run the turn).
"""

from typing import Any

from forge_rl.data.images import encode_png, load_image
from forge_rl.data.vision import with_images


class TurnImages:
    """The images of one trajectory so far, in the order of their placeholders."""

    def __init__(self, images=()):
        self.images: list[Any] = list(images)

    def messages(self, step, where: str) -> list[dict]:
        """The step's messages, with its images (if any) as image parts, and the images added to the trajectory's.
        A bad image (a missing file, an unreadable one) is a DataError naming the step."""
        images = list(getattr(step, "images", None) or ())
        if not images:
            return list(step.messages)
        messages = with_images([dict(m) for m in step.messages], len(images), where)
        self.images += [_bytes(image, f"{where} image {i}") for i, image in enumerate(images)]
        return messages

    def generate_args(self) -> dict[str, Any]:
        """The generate call's `images` (none for a text conversation)."""
        return {"images": list(self.images)} if self.images else {}

    def expanded(self, inserted: list[int], turn, ran: int) -> list[int]:
        """The environment's tokens `inserted` as the engine ran them: their image placeholders expanded, read from
        the next turn's prompt (`turn.prompt_ids`, the engine's), of which the first `ran` ids were there before."""
        if not self.images:
            return inserted
        return turn.prompt_ids[ran:].tolist()


def _bytes(image: Any, where: str) -> bytes:
    """An environment's image as encoded bytes (what a Completion keeps), checked as a task row's image is."""
    if isinstance(image, (bytes, bytearray)):
        load_image(image, where)
        return bytes(image)
    return encode_png(load_image(image, where))
