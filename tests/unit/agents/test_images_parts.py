"""The endpoint's OpenAI image content parts (forge_rl/agents/images.py) with the embedded models' real tokenizers:
a data: URL's image becomes the model's own placeholder in the message and its bytes go with the call; each bad
part is refused in one line naming it. The engine's side is tests/integration/test_vision.py."""

import base64
import io
import itertools

import pytest

from forge_rl.agents.episodes import Refused
from forge_rl.agents.images import ImageParts
from forge_rl.data import digit_sum
from forge_rl.deps.transformers import auto_tokenizer
from forge_rl.models import resolve_model_path


@pytest.fixture(scope="module")
def vision():
    return ImageParts(auto_tokenizer(resolve_model_path("tiny-vlm")))


@pytest.fixture(scope="module")
def png():
    return next(itertools.islice(digit_sum.training_rows(seed=0), 1))["image"]


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def test_an_image_part_becomes_the_models_placeholder_and_its_bytes(vision, png):
    messages = [
        {"role": "system", "content": "Answer with a number."},
        {"role": "user", "content": [image_part(data_url(png)), {"type": "text", "text": "Add the two digits."}]},
    ]
    sent, images = vision.take(messages)
    assert images == [png]
    assert sent[0] == messages[0]
    assert sent[1]["content"] == [{"type": "text", "text": "<image>"}, {"type": "text", "text": "Add the two digits."}]
    two = [{"role": "user", "content": [image_part(data_url(png)), image_part(data_url(png))]}]
    assert vision.take(two)[1] == [png, png]
    assert vision.take([{"role": "user", "content": "no image"}]) == ([{"role": "user", "content": "no image"}], [])


def test_bad_image_parts_are_refused_in_one_line(vision, png):
    from PIL import Image

    tiff = io.BytesIO()
    Image.new("RGB", (4, 4)).save(tiff, format="TIFF")
    cases = {
        "https://example.com/a.png": "is not a data: URL (the endpoint fetches nothing)",
        "data:image/png,rawbytes": "is not base64",
        "data:image/png;base64,@@not base64@@": "base64 does not decode",
        data_url(b"not an image"): "is not an image PIL can read",
        data_url(tiff.getvalue()): "is TIFF, a format the processors do not take",
    }
    for url, why in cases.items():
        with pytest.raises(Refused, match="messages\\[0\\].content\\[1\\]") as refused:
            vision.take([{"role": "user", "content": [{"type": "text", "text": "x"}, image_part(url)]}])
        assert why in str(refused.value) and len(str(refused.value).splitlines()) == 1
        assert refused.value.reason == "agent_request"
    text_only = ImageParts(auto_tokenizer(resolve_model_path("tiny")))
    with pytest.raises(Refused, match="an image_url part, but the model .*tiny is text-only; send text only"):
        text_only.take([{"role": "user", "content": [image_part(data_url(png))]}])
