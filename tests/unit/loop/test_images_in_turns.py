"""A trajectory's images (forge_rl/loop/turn_images.py): an environment step's images become image parts at its
markers and join the row's, in order; a bad one is one line naming the step. The engine's side (expansion, exact
logprobs) is tests/integration/test_vision.py."""

import itertools

import pytest

from forge_rl.data import digit_sum
from forge_rl.envs.environment import EnvStep
from forge_rl.errors import DataError
from forge_rl.loop.turn_images import TurnImages


@pytest.fixture(scope="module")
def pngs():
    return [row["image"] for row in itertools.islice(digit_sum.training_rows(seed=0), 2)]


def test_a_steps_images_join_the_rows_at_its_markers(pngs):
    turns = TurnImages([pngs[0]])
    text = EnvStep(messages=[{"role": "user", "content": "Try again."}])
    assert turns.messages(text, "step 1") == text.messages and turns.generate_args() == {"images": [pngs[0]]}
    shown = EnvStep(messages=[{"role": "user", "content": "And <image>?"}], images=[pngs[1]])
    assert turns.messages(shown, "step 2") == [
        {
            "role": "user",
            "content": [{"type": "text", "text": "And "}, {"type": "image"}, {"type": "text", "text": "?"}],
        }
    ]
    assert turns.images == pngs and turns.generate_args() == {"images": pngs}
    assert TurnImages().generate_args() == {}
    assert TurnImages().expanded([5, 6], None, 0) == [5, 6]  # a text conversation's tokens are as sent


def test_a_bad_image_or_marker_count_is_one_line_naming_the_step(pngs):
    with pytest.raises(DataError, match="^environment step 1 image 0: image bytes is not an image PIL can read"):
        TurnImages().messages(
            EnvStep(messages=[{"role": "user", "content": "<image>"}], images=[b"x"]), "environment step 1"
        )
    with pytest.raises(DataError, match="^step 2: 2 image placeholders"):
        TurnImages().messages(
            EnvStep(messages=[{"role": "user", "content": "<image><image>"}], images=pngs[:1]), "step 2"
        )
