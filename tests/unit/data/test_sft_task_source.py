"""SFT on the run's task (`dataset: task`, forge_rl/data/sft_sources.py TaskSource): the task's rows, rendered by
the model's chat template, their answers the targets. A vision-language model's rows keep their images, and their
prompts are the ids the engine gives them: each placeholder expanded to the image's tokens by the processor."""

import pytest

from forge_rl.data.sft_sources import make_source, train_batches
from forge_rl.data.sources import DataError
from forge_rl.data.task import TaskConfig, TaskRows, render
from forge_rl.deps.transformers import auto_tokenizer
from forge_rl.models import resolve_model_path


def test_a_vision_tasks_rows_become_sft_examples_with_expanded_prompts_and_their_images():
    from forge_rl.data.images import load_image
    from forge_rl.data.vision import load_processor
    from forge_rl.models.build_tiny_vlm import IMAGE_TOKEN_ID, IMAGE_TOKENS

    model_dir = resolve_model_path("tiny-vlm")
    tokenizer = auto_tokenizer(model_dir)
    task = TaskConfig(source="digit_sum")
    source = make_source("task", tokenizer, seed=0, max_len=512, task=task)
    row = TaskRows(task, seed=0).next()
    ex = source.example(0)
    engine = load_processor(model_dir)(
        text=[render(tokenizer, row, task.resolved())], images=[[load_image(row.images[0], "row")]]
    )
    assert ex.prompt_ids == engine["input_ids"][0] and ex.prompt_ids.count(IMAGE_TOKEN_ID) == IMAGE_TOKENS
    assert tokenizer.decode(ex.response_ids) == row.answer + tokenizer.eos_token and ex.images == row.images
    (batch,) = train_batches(source, step=0, batch_size=3, dp=1, pad_id=0)
    assert batch.images == [source.example(i).images for i in range(3)] and all(len(i) == 1 for i in batch.images)


def test_a_text_task_trains_on_its_answers_and_a_task_without_answers_is_refused():
    tokenizer = auto_tokenizer(resolve_model_path("tiny"))
    source = make_source("task", tokenizer, seed=0, max_len=128, task=TaskConfig(source="arithmetic"))
    ex = source.example(5)
    assert tokenizer.decode(ex.response_ids).endswith(tokenizer.eos_token) and not ex.images
    (batch,) = train_batches(source, step=0, batch_size=2, dp=1, pad_id=0)
    assert batch.images is None
    no_answers = make_source("task", tokenizer, 0, 128, task=TaskConfig(source="arithmetic", answer_column=None))
    with pytest.raises(DataError, match="no answer to train on"):
        no_answers.example(0)
