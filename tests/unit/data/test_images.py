"""Images in task rows (forge_rl/data/images.py): every form a row may hold, and each bad image refused in one line
naming the row, before any engine starts."""

import io
import json

import pytest
from PIL import Image

from forge_rl.data.images import DEFAULT_MAX_PIXELS, load_image, max_image_pixels, row_images
from forge_rl.data.task import TaskConfig, TaskRows
from forge_rl.errors import DataError


def png(size=(20, 10), color="red") -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, format="PNG")
    return buffer.getvalue()


def noisy_png() -> bytes:
    buffer = io.BytesIO()
    Image.effect_noise((64, 64), 60).convert("RGB").save(buffer, format="PNG")
    return buffer.getvalue()


NOISY_PNG = noisy_png()


def test_every_form_of_an_image_loads_as_rgb(tmp_path):
    (tmp_path / "a.png").write_bytes(png())
    rgba = Image.new("RGBA", (20, 10))
    forms = [
        str(tmp_path / "a.png"),
        tmp_path / "a.png",
        "a.png",  # relative to the data file's folder
        png(),
        {"bytes": png(), "path": None},  # a datasets Image column that does not decode
        {"bytes": None, "path": str(tmp_path / "a.png")},
        rgba,  # a datasets Image column that decodes: a PIL image
    ]
    for value in forms:
        image = load_image(value, "row 1", base_dir=tmp_path)
        assert image.mode == "RGB" and image.size == (20, 10), value


@pytest.mark.parametrize(
    "value, message",
    [
        ("missing.png", "row 3: image file '.*missing.png' does not exist"),
        (b"not an image", "row 3: image bytes is not an image PIL can read"),
        (NOISY_PNG[: len(NOISY_PNG) // 2], "row 3: image bytes cannot be decoded"),  # the header reads, pixels not
        ({"bytes": None, "path": None}, "holds no image"),
        (42, "an image must be a path, bytes, a PIL image or a datasets Image value, got int"),
    ],
    ids=["missing", "not an image", "truncated", "empty column value", "not an image type"],
)
def test_a_missing_unreadable_or_truncated_image_is_one_line(tmp_path, value, message):
    with pytest.raises(DataError, match=message):
        load_image(value, "row 3", base_dir=tmp_path)


def test_an_unsupported_format_is_refused_though_pil_reads_it(tmp_path):
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buffer, format="TIFF")
    with pytest.raises(DataError, match="is TIFF, a format the processors do not take"):
        load_image(buffer.getvalue(), "row 0")


def test_an_image_over_the_limit_is_refused_from_its_header():
    with pytest.raises(DataError, match=r"20x10 = 200 pixels, over the processor's limit of 199"):
        load_image(png(), "row 0", max_pixels=199)
    with pytest.raises(DataError, match="over the processor's limit"):
        load_image(Image.new("RGB", (20, 10)), "row 0", max_pixels=199)
    assert load_image(png(), "row 0", max_pixels=200).size == (20, 10)


def test_the_limit_is_the_processors_own_where_it_declares_one():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    qwen = Qwen2VLImageProcessorPil(size={"shortest_edge": 56 * 56, "longest_edge": 1000 * 28 * 28})
    assert max_image_pixels(qwen) == 1000 * 28 * 28
    assert max_image_pixels(object()) == DEFAULT_MAX_PIXELS


def test_row_images_one_or_a_list_as_png_bytes(tmp_path):
    assert row_images({"x": 1}, "row 0", None, None) == ()
    one = row_images({"image": png()}, "row 0", "image", None)
    assert len(one) == 1 and one[0] == png()  # PNG bytes travel as they are
    two = row_images({"image": [png(), Image.new("L", (4, 4))]}, "row 0", "image", None)
    assert len(two) == 2 and Image.open(io.BytesIO(two[1])).format == "PNG"
    with pytest.raises(DataError, match=r"row 0: no column 'img' \(task.image_column\)"):
        row_images({"image": png()}, "row 0", "img", None)
    with pytest.raises(DataError, match=r"row 0 image\[1\]: image bytes is not an image"):
        row_images({"image": [png(), b"junk"]}, "row 0", "image", None)
    with pytest.raises(DataError, match="holds no image"):
        row_images({"image": []}, "row 0", "image", None)


def test_jsonl_rows_with_image_paths_relative_to_the_file(tmp_path):
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.png").write_bytes(png())
    rows = [
        {"prompt": "What colour is <image>?", "image": "img/a.png", "answer": "red"},
        {"prompt": "Compare <image> with <image>.", "image": ["img/a.png", "img/a.png"], "answer": "same"},
    ]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = TaskRows(TaskConfig(source=str(tmp_path / "train.jsonl"), image_column="image", shuffle=False))
    first, second = task.next(), task.next()
    assert len(first.images) == 1 and len(second.images) == 2 and "image" not in first.columns
    assert first.messages[0]["content"] == [
        {"type": "text", "text": "What colour is "},
        {"type": "image"},
        {"type": "text", "text": "?"},
    ]
    (tmp_path / "bad.jsonl").write_text(json.dumps({**rows[0], "image": "img/gone.png"}) + "\n")
    with pytest.raises(DataError, match=r"bad.jsonl:1 image: image file '.*gone.png' does not exist"):
        TaskRows(TaskConfig(source=str(tmp_path / "bad.jsonl"), image_column="image"))


def test_an_hf_dataset_with_an_image_column(tmp_path):
    import datasets

    features = datasets.Features(
        {"prompt": datasets.Value("string"), "image": datasets.Image(), "answer": datasets.Value("string")}
    )
    rows = {"prompt": ["What colour?"], "image": [Image.new("RGB", (6, 6), "blue")], "answer": ["blue"]}
    datasets.Dataset.from_dict(rows, features=features).save_to_disk(str(tmp_path / "ds"))
    (example,) = TaskRows(TaskConfig(source=str(tmp_path / "ds"), image_column="image")).examples
    assert Image.open(io.BytesIO(example.images[0])).getpixel((0, 0)) == (0, 0, 255)
    assert example.messages[0]["content"][0] == {"type": "image"}  # no marker: the image starts the user turn


def test_the_models_limit_is_read_from_its_processor_config(tmp_path):
    from forge_rl.data.images import check_image_sizes, model_max_pixels
    from forge_rl.models import resolve_model_path

    assert model_max_pixels(resolve_model_path("tiny-vlm")) == DEFAULT_MAX_PIXELS  # it resizes every image
    assert model_max_pixels(resolve_model_path("tiny")) == DEFAULT_MAX_PIXELS  # no processor at all
    qwen = dict(image_processor_type="Qwen2VLImageProcessor", size={"shortest_edge": 3136, "longest_edge": 150})
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(qwen))
    assert model_max_pixels(tmp_path) == 150
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"max_pixels": 300}))
    assert model_max_pixels(tmp_path) == 300
    check_image_sizes((png(),), 200, "row 0")
    with pytest.raises(DataError, match=r"row 0 image 1 is 20x10 = 200 pixels, over the processor's limit of 150"):
        check_image_sizes((png((5, 5)), png()), 150, "row 0")
