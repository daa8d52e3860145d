"""Images in task rows: what a row's image value may be, and the checks that refuse a bad one before any engine
starts.

An image value is one of
- a path (str or Path; relative paths are taken from the data file's folder, `base_dir`);
- the file's bytes;
- a `datasets` Image column's value: a PIL image when the column decodes, or `{"bytes": ..., "path": ...}` when
  it does not;
- a PIL image.

`load_image` opens it, checks it and returns it as an RGB PIL image; anything wrong is one `DataError` line naming
the row (`where`): a missing or unreadable file, a format the processors do not read (`IMAGE_FORMATS`), or more
pixels than the limit. The limit is read from the header, before the pixels are decoded, so a huge image costs
nothing to refuse.
"""

import io
import json
from pathlib import Path
from typing import Any

from forge_rl.errors import DataError

# What transformers' image processors and vLLM's image loader both read through PIL.
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
# The limit for a processor that declares none (those that resize every image to a fixed size): a larger image
# only costs decoding and resizing time in the dataset and generator processes, for pixels the model never sees.
DEFAULT_MAX_PIXELS = 4096 * 4096
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def max_image_pixels(processor: Any) -> int:
    """The most pixels an image may have for `processor` (a transformers processor, or its image processor): its
    own `max_pixels` (Qwen-VL processors; `size["longest_edge"]` is the same limit there), else DEFAULT_MAX_PIXELS."""
    image_processor = getattr(processor, "image_processor", processor)
    declared = getattr(image_processor, "max_pixels", None)
    if declared is None and "Qwen2VL" in type(image_processor).__name__:
        declared = (getattr(image_processor, "size", None) or {}).get("longest_edge")
    return int(declared) if declared else DEFAULT_MAX_PIXELS


def model_max_pixels(model_dir: str | Path) -> int:
    """`max_image_pixels` of the model's processor, read from its preprocessor_config.json without loading it."""
    try:
        config = json.loads((Path(model_dir) / "preprocessor_config.json").read_text())
    except (OSError, ValueError):
        return DEFAULT_MAX_PIXELS
    if not isinstance(config, dict):
        return DEFAULT_MAX_PIXELS
    declared = config.get("max_pixels")
    if declared is None and str(config.get("image_processor_type", "")).startswith("Qwen2VL"):
        declared = (config.get("size") or {}).get("longest_edge")
    return int(declared) if isinstance(declared, (int, float)) and declared > 0 else DEFAULT_MAX_PIXELS


def check_image_sizes(images: tuple[bytes, ...], max_pixels: int, where: str) -> None:
    """A DataError when one of a row's (already loaded) images has more than `max_pixels` pixels: the header only."""
    from PIL import Image

    for i, data in enumerate(images):
        with Image.open(io.BytesIO(data)) as image:
            _check_size(image, f"{where} image {i}" if len(images) > 1 else f"{where} image", max_pixels)


def load_image(value: Any, where: str, max_pixels: int = DEFAULT_MAX_PIXELS, base_dir: Path | None = None):
    """The image `value` (see the module docstring) as an RGB PIL image, or a DataError naming `where`."""
    from PIL import Image

    if isinstance(value, Image.Image):
        _check_size(value, where, max_pixels)
        return value.convert("RGB")
    if isinstance(value, dict):  # a datasets Image column that does not decode: {"bytes": ..., "path": ...}
        if value.get("bytes") is not None:
            value = value["bytes"]
        elif value.get("path") is not None:
            value = value["path"]
        else:
            raise DataError(f"{where}: an image column value {{'bytes': None, 'path': None}} holds no image")
    if isinstance(value, (bytes, bytearray)):
        return _open(io.BytesIO(value), f"{where}: image bytes", max_pixels)
    if isinstance(value, (str, Path)):
        path = Path(value).expanduser()
        if not path.is_absolute() and base_dir is not None:
            path = base_dir / path
        if not path.is_file():
            raise DataError(f"{where}: image file {str(path)!r} does not exist")
        return _open(path, f"{where}: image file {str(path)!r}", max_pixels)
    raise DataError(
        f"{where}: an image must be a path, bytes, a PIL image or a datasets Image value, got {type(value).__name__}"
    )


def _open(source, what: str, max_pixels: int):
    """Open, check the header (format, size), then decode."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(source)
    except Image.DecompressionBombError as e:  # PIL's own limit, far above any processor's
        raise DataError(f"{what} is too large ({e}); resize it first") from None
    except UnidentifiedImageError:
        raise DataError(f"{what} is not an image PIL can read (formats: {', '.join(IMAGE_FORMATS)})") from None
    except OSError as e:
        raise DataError(f"{what} cannot be read ({type(e).__name__}: {e})") from None
    if image.format not in IMAGE_FORMATS:
        raise DataError(f"{what} is {image.format}, a format the processors do not take; use one of {IMAGE_FORMATS}")
    _check_size(image, what, max_pixels)
    try:
        return image.convert("RGB")  # decodes: a truncated or corrupt file fails here
    except (OSError, ValueError) as e:
        raise DataError(f"{what} cannot be decoded ({type(e).__name__}: {e})") from None


def _check_size(image, what: str, max_pixels: int) -> None:
    width, height = image.size
    if width < 1 or height < 1:
        raise DataError(f"{what} is empty ({width}x{height})")
    if width * height > max_pixels:
        raise DataError(
            f"{what} is {width}x{height} = {width * height:,} pixels, over the processor's limit of {max_pixels:,}; "
            "resize it first"
        )


def encode_png(image) -> bytes:
    """`image` as PNG bytes: how images travel between processes (compact, lossless, re-read by `load_image`)."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def row_images(row: dict, where: str, column: str | None, base_dir: Path | None) -> tuple[bytes, ...]:
    """The images of a task row's `column` (task.image_column: one image or a list), each checked and PNG-encoded;
    () when the task has no image column."""
    if column is None:
        return ()
    if column not in row:
        raise DataError(f"{where}: no column {column!r} (task.image_column); the row has {sorted(row)}")
    values = row[column]
    values = list(values) if isinstance(values, (list, tuple)) else [values]
    if not values:
        raise DataError(f"{where}: column {column!r} (task.image_column) holds no image")
    where_each = (lambda i: f"{where} {column}[{i}]") if len(values) > 1 else (lambda i: f"{where} {column}")
    return tuple(_png(v, where_each(i), base_dir) for i, v in enumerate(values))


def _png(value: Any, where: str, base_dir: Path | None) -> bytes:
    """A row's image as PNG bytes: PNG files and bytes as they are once checked, anything else re-encoded."""
    image = load_image(value, where, base_dir=base_dir)
    if isinstance(value, (bytes, bytearray)) and bytes(value[:8]) == PNG_SIGNATURE:
        return bytes(value)
    return encode_png(image)


def image_base_dir(source: str) -> Path | None:
    """Where a row's relative image paths start: the data file's folder, or the dataset directory."""
    path = Path(source).expanduser()
    if path.is_file():
        return path.parent
    return path if path.is_dir() else None
