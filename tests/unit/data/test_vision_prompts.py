"""Image prompts (forge_rl/data/vision.py) with tiny-vlm's real processor: markers to image parts, the processor's
chat template placing its image token, and the refusals before any engine starts: a text-only model given images,
more (or fewer) placeholders than images."""

import pytest

from forge_rl.data.vision import (
    check_placeholders,
    check_vision_model,
    image_token_id,
    is_vision_model,
    load_processor,
    model_config,
    render_image_prompt,
    with_images,
)
from forge_rl.errors import ConfigError, DataError
from forge_rl.models import resolve_model_path

VLM = resolve_model_path("tiny-vlm")


@pytest.fixture(scope="module")
def processor():
    return load_processor(VLM)


def user(text: str) -> list[dict]:
    return [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": text}]


def test_markers_become_image_parts_in_place():
    (system, turn) = with_images(user("Add <image> and <image>."), 2, "row 0")
    assert system == {"role": "system", "content": [{"type": "text", "text": "Answer with a number."}]}
    assert turn["content"] == [
        {"type": "text", "text": "Add "},
        {"type": "image"},
        {"type": "text", "text": " and "},
        {"type": "image"},
        {"type": "text", "text": "."},
    ]


def test_without_markers_the_images_start_the_first_user_turn():
    (_, turn) = with_images(user("Add the digits."), 2, "row 0")
    assert turn["content"] == [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Add the digits."}]


@pytest.mark.parametrize(
    "text, images, message",
    [
        ("Add <image> and <image>.", 1, "row 4: 2 image placeholders \\(<image>\\) but 1 images"),
        ("Add <image> and <image>.", 0, "row 4: 2 image placeholders \\(<image>\\) but 0 images"),
        ("Add <image> and this.", 2, "row 4: 2 images but only 1 image placeholders"),
    ],
)
def test_a_marker_count_that_is_not_the_image_count_is_refused(text, images, message):
    with pytest.raises(DataError, match=message):
        with_images(user(text), images, "row 4")


def test_the_processor_renders_one_image_token_per_image(processor):
    text = render_image_prompt(processor, with_images(user("Add <image> and <image>."), 2, "row 0"), 2, "row 0")
    assert text.endswith("<|im_start|>user\nAdd <image> and <image>.<|im_end|>\n<|im_start|>assistant\n")
    ids = processor.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids.count(image_token_id(model_config(VLM))) == 2  # one placeholder token each, before expansion


def test_more_placeholders_in_the_rendered_prompt_than_images_is_refused(processor):
    # a literal <image> in a turn the markers do not cover (an assistant few-shot answer here)
    messages = with_images(user("Add <image>."), 1, "row 2") + [{"role": "assistant", "content": "<image>"}]
    with pytest.raises(DataError, match=r"row 2: the prompt holds 2 image placeholders \(<image>\), more than its 1"):
        render_image_prompt(processor, messages, 1, "row 2")
    with pytest.raises(DataError, match="holds 0 image placeholders .*, fewer than its 1 images"):
        check_placeholders("no image here", 1, processor, "row 2")


def test_a_text_only_model_given_images_is_refused_in_one_line():
    tiny = resolve_model_path("tiny")
    assert is_vision_model(VLM) and not is_vision_model(tiny)
    assert image_token_id(model_config(tiny)) is None
    with pytest.raises(ConfigError, match=r"model='.*tiny' is a text-only model \(its config.json has no vision"):
        check_vision_model(tiny)
    with pytest.raises(ConfigError, match="is a text-only model"):
        load_processor(tiny)


def test_a_task_with_images_rendered_for_a_text_only_model_is_refused_before_any_engine():
    """What a run's start-up checks do with the first prompts (forge_rl/recipes/grpo_checks.py renders them)."""
    from forge_rl.data.task import TaskConfig, TaskRows, render
    from forge_rl.deps.transformers import auto_tokenizer

    task = TaskConfig(source="digit_sum")
    example = TaskRows(task).next()
    with pytest.raises(ConfigError, match="is a text-only model .*, but the prompts have images"):
        render(auto_tokenizer(resolve_model_path("tiny")), example, task)
    assert render(auto_tokenizer(VLM), example, task).count("<image>") == 1
