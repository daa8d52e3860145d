"""A Generator's image inputs (forge_rl/actors/generator_images.py), checked before the engine sees the request."""

import io

import pytest
from PIL import Image

from forge_rl.actors.generator_images import image_engine_args, image_inputs
from forge_rl.models import resolve_model_path

IMAGE_TOKEN = 100


def png() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), "white").save(buffer, format="PNG")
    return buffer.getvalue()


def test_one_image_per_placeholder_becomes_vllms_multimodal_input_and_is_recorded_as_bytes():
    given = png()
    inputs = image_inputs([1, IMAGE_TOKEN, 5, IMAGE_TOKEN, 2], [given, Image.new("L", (4, 4))], IMAGE_TOKEN, "m")
    assert [image.mode for image in inputs["image"]] == ["RGB", "RGB"] and set(inputs) == {"image", "recorded"}
    first, second = inputs["recorded"]
    assert first == given  # image bytes are recorded as given
    assert Image.open(io.BytesIO(second)).format == "PNG"  # a PIL image is encoded once


@pytest.mark.parametrize(
    "ids, images, token, message",
    [
        ([1, 5, 2], [png()], None, "given 1 images, but the generator's model m is text-only"),
        ([1, IMAGE_TOKEN, IMAGE_TOKEN, 2], [png()], IMAGE_TOKEN, "holds 2 image placeholders .*, more than its 1"),
        ([1, IMAGE_TOKEN, 2], [png(), png()], IMAGE_TOKEN, "holds 1 image placeholders .*, fewer than its 2"),
        ([1, IMAGE_TOKEN, 2], [], IMAGE_TOKEN, "holds 1 image placeholders .*, more than its 0 images"),
        ([1, IMAGE_TOKEN, 2], [b"junk"], IMAGE_TOKEN, "image 0 of the prompt: image bytes is not an image"),
    ],
    ids=["text-only model", "more placeholders", "fewer placeholders", "no images", "not an image"],
)
def test_what_the_engine_could_not_take_is_refused(ids, images, token, message):
    with pytest.raises(ValueError, match=message):
        image_inputs(ids, images, token, "m")


def test_a_vision_language_engine_runs_without_the_multimodal_input_cache_a_swap_would_desync():
    assert image_engine_args(resolve_model_path("tiny-vlm")) == {"mm_processor_cache_gb": 0}
    assert image_engine_args(resolve_model_path("tiny")) == {}
