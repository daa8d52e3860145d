"""The digit-sum task (forge_rl/data/digit_sum.py): images from a seed, held-out images never trained on, and the
task a run names."""

import io
import itertools

from PIL import Image

from forge_rl.data import digit_sum
from forge_rl.data.task import TaskConfig, TaskRows


def test_rows_are_deterministic_and_their_answer_is_the_sum():
    first = list(itertools.islice(digit_sum.training_rows(seed=3), 5))
    again = list(itertools.islice(digit_sum.training_rows(seed=3), 5))
    assert first == again and first != list(itertools.islice(digit_sum.training_rows(seed=4), 5))
    layouts = list(itertools.islice(digit_sum.iter_layouts(3, held_out=False), 5))
    for row, layout in zip(first, layouts):
        assert row["answer"] == str(layout.left.value + layout.right.value)
        assert row["prompt"].count("<image>") == 1
        assert Image.open(io.BytesIO(row["image"])).size == (digit_sum.IMAGE_SIZE, digit_sum.IMAGE_SIZE)


def test_digits_vary_in_size_and_position_and_stay_in_their_half():
    layouts = list(itertools.islice(digit_sum.iter_layouts(0, held_out=False), 300))
    lefts, rights = [la.left for la in layouts], [la.right for la in layouts]
    assert len({d.size for d in lefts}) > 5 and len({(d.x, d.y) for d in lefts}) > 50
    assert all(d.x < digit_sum.IMAGE_SIZE // 2 <= e.x for d, e in zip(lefts, rights))
    assert {d.value for d in lefts + rights} == set(range(10))


def test_held_out_images_are_never_training_images():
    held_out = digit_sum.held_out_rows(100)
    assert len(held_out) == 100 and held_out == digit_sum.held_out_rows(100)
    held_layouts = set(itertools.islice(digit_sum.iter_layouts(digit_sum.HELD_OUT_SEED, held_out=True), 500))
    for seed in (0, 1):  # layouts decide the images: thousands of them, then the drawn images of a few hundred
        assert not held_layouts & set(itertools.islice(digit_sum.iter_layouts(seed, held_out=False), 5000))
        train_images = {row["image"] for row in itertools.islice(digit_sum.training_rows(seed=seed), 200)}
        assert not {row["image"] for row in held_out} & train_images
    assert all(la.held_out() for la in held_layouts)


def test_digit_sum_is_a_task_a_run_names():
    task = TaskRows(TaskConfig(source="digit_sum"), seed=0)
    example = task.next()
    assert len(example.images) == 1 and example.answer.isdigit() and "image" not in example.columns
    assert example.messages == [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Add the two digits."}]}
    ]
    assert len(task.held_out()) == digit_sum.HELD_OUT_POOL


def test_digit_read_asks_for_the_digits_of_the_same_images():
    summed, read = TaskRows(TaskConfig(source="digit_sum"), seed=3), TaskRows(TaskConfig(source="digit_read"), seed=3)
    for _ in range(20):
        a, b = summed.next(), read.next()
        assert a.images == b.images and len(b.answer) == 2
        assert int(b.answer[0]) + int(b.answer[1]) == int(a.answer)
    assert read.next().messages[0]["content"][1]["text"] == "Read the two digits."
    assert [e.images for e in read.held_out()] == [e.images for e in summed.held_out()]
