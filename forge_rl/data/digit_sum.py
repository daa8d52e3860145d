"""A procedural visual task: two digits drawn into a small image, the answer their sum (`digit_sum`), or the two
digits read left to right (`digit_read`: the same images, a question that needs no arithmetic).

    task:
      source: digit_sum        # training rows, endless; held-out rows: a fixed pool (digit_read alike)

Each image is IMAGE_SIZE pixels square, white, with the first digit somewhere in its left half and the second in
its right half, each at a random size, position and grey level. The image is fully described by its `Layout`,
and the layout decides the split: a layout whose stable hash falls in the held-out bucket is only ever a held-out
image, any other only a training one, so no held-out image is trained on (for any training seed). Rows carry the
image as PNG bytes in the `image` column and the question with its image marker in `prompt`.
"""

import hashlib
import itertools
import random
from dataclasses import astuple, dataclass

from forge_rl.data.images import encode_png
from forge_rl.data.vision import IMAGE_MARKER

IMAGE_SIZE = 64
DIGIT_SIZES = (14, 30)  # the font size range, in pixels
QUESTION = f"{IMAGE_MARKER}Add the two digits."
READ_QUESTION = f"{IMAGE_MARKER}Read the two digits."
HELD_OUT_BUCKETS = 10  # one layout in HELD_OUT_BUCKETS is held out
HELD_OUT_SEED = 20261202
HELD_OUT_POOL = 500


@dataclass(frozen=True)
class Digit:
    value: int
    x: int
    y: int
    size: int
    grey: int  # 0 black .. 160 light grey, on white


@dataclass(frozen=True)
class Layout:
    left: Digit
    right: Digit

    @property
    def answer(self) -> str:
        return str(self.left.value + self.right.value)

    @property
    def reading(self) -> str:
        return f"{self.left.value}{self.right.value}"

    def held_out(self) -> bool:
        """Whether this layout belongs to the held-out split: a stable hash of everything that draws it."""
        digest = hashlib.sha256(repr(astuple(self)).encode()).digest()
        return digest[0] % HELD_OUT_BUCKETS == 0


def random_digit(rng: random.Random, half: int) -> Digit:
    """A digit placed inside half `half` (0 left, 1 right) of the image, whatever its size."""
    size = rng.randint(*DIGIT_SIZES)
    width = IMAGE_SIZE // 2
    x = half * width + rng.randint(0, max(0, width - size * 2 // 3))
    y = rng.randint(0, IMAGE_SIZE - size)
    return Digit(rng.randint(0, 9), x, y, size, rng.randint(0, 160))


def random_layout(rng: random.Random) -> Layout:
    return Layout(random_digit(rng, 0), random_digit(rng, 1))


def draw(layout: Layout):
    """The layout as an RGB PIL image."""
    from PIL import Image, ImageDraw, ImageFont

    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), "white")
    pen = ImageDraw.Draw(image)
    for digit in (layout.left, layout.right):
        font = ImageFont.load_default(size=digit.size)
        pen.text((digit.x, digit.y), str(digit.value), fill=(digit.grey,) * 3, font=font)
    return image


def row(layout: Layout, row_id: str, read: bool = False) -> dict:
    answer = layout.reading if read else layout.answer
    return {
        "id": row_id,
        "prompt": READ_QUESTION if read else QUESTION,
        "image": encode_png(draw(layout)),
        "answer": answer,
    }


def iter_layouts(seed: int, held_out: bool):
    """An endless, deterministic stream of the layouts of one split (prefix-stable for a seed)."""
    rng = random.Random(seed)
    while True:
        layout = random_layout(rng)
        if layout.held_out() == held_out:
            yield layout


# ---- as a task (task.source: digit_sum) -------------------------------------------------------------------


def training_rows(seed: int = 0, read: bool = False):
    """Training rows, endless: {"id", "prompt", "image" (PNG bytes), "answer"}; never a held-out layout."""
    for i, layout in enumerate(iter_layouts(seed, held_out=False)):
        yield row(layout, f"digits-{seed}-{i}", read)


def held_out_rows(n: int = HELD_OUT_POOL, read: bool = False) -> list[dict]:
    """The first `n` rows of the fixed held-out pool (the same for every run and seed)."""
    layouts = itertools.islice(iter_layouts(HELD_OUT_SEED, held_out=True), n)
    return [row(layout, f"digits-heldout-{i}", read) for i, layout in enumerate(layouts)]


# ---- as a task (task.source: digit_read) ------------------------------------------------------------------


def reading_rows(seed: int = 0):
    """digit_read's training rows: training_rows' images, "Read the two digits.", the answer e.g. "37"."""
    return training_rows(seed, read=True)


def held_out_reading_rows() -> list[dict]:
    return held_out_rows(read=True)
