"""Images beside the tokens (forge_rl/types.py): a group's completions share one tuple of images, which crosses a
process boundary once however many completions hold it, and the TrainBatch records each row's images."""

import pickle

import torch

from forge_rl.types import Completion, Episode, TrainBatch


def completion(images: tuple[bytes, ...], n: int = 3) -> Completion:
    return Completion(
        torch.tensor([1, 100, 2]),
        torch.arange(3, 3 + n),
        torch.full((n,), -0.5),
        torch.zeros(n, dtype=torch.long),
        "stop",
        images=images,
    )


def test_a_groups_shared_images_cross_once():
    image = bytes(range(256)) * 400  # 100 KB
    images = (image,)  # as the generator gives a group's completions
    group = [completion(images) for _ in range(8)]
    wire = pickle.dumps(group)
    assert len(image) < len(wire) < 2 * len(image)
    back = pickle.loads(wire)
    assert all(c.images == (image,) for c in back) and back[0].images is back[7].images


def test_the_batch_records_each_rows_images_and_none_for_text():
    a, b = b"first image", b"second image"
    episodes = [Episode(completion((a, b)), advantage=1.0), Episode(completion(()), advantage=0.0)]
    batch = pickle.loads(pickle.dumps(TrainBatch.collate(episodes, pad_id=0)))
    assert batch.images == [(a, b), ()] and batch.tokens.shape == (2, 6)
    text = [Episode(completion(()), advantage=0.0)]
    assert TrainBatch.collate(text, pad_id=0).images is None
