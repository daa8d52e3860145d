"""The trainer's vision-language model (forge_rl/models/vision_language.py) on the embedded tiny-vlm, in one
process: its names map to the checkpoint's and back; the image tokens' embeddings are the images' features, in
order, except the ids the model sampled (text, as the engine embeds them); a count the images do not make is an
error naming both. Logits against transformers' and the engine's: tests/integration/test_vision.py."""

import itertools

import pytest
import torch

from forge_rl.models import resolve_model_path

TINY_VLM = resolve_model_path("tiny-vlm")


@pytest.fixture(scope="module")
def tower():
    from forge_rl.models.qwen3_config import read_hf_config
    from forge_rl.models.vision_language import VisionTower

    torch.manual_seed(0)
    return VisionTower(read_hf_config(TINY_VLM)).eval()


def test_the_checkpoints_names_map_onto_the_model_and_back():
    from safetensors import safe_open
    from torchtitan.models.qwen3 import Qwen3StateDictAdapter

    from forge_rl.models.vision_language import VisionLanguageAdapter, titan_config

    config = titan_config(TINY_VLM)
    adapter = VisionLanguageAdapter(Qwen3StateDictAdapter(config, TINY_VLM))
    with safe_open(f"{TINY_VLM}/model.safetensors", "pt") as f:
        names = set(f.keys())
    ours = adapter.from_hf({name: torch.empty(0) for name in names})
    assert "tok_embeddings.weight" in ours and "vision.connector.modality_projection.proj.weight" in ours
    assert not any("q_norm" in name for name in ours)  # a Llama: no per-head q/k norms
    assert config.enable_weight_tying and set(adapter.to_hf(ours)) == names - {"lm_head.weight"}  # tied: the embedding
    assert all(layer.attention.qk_norm is None for layer in config.layers)


def test_image_tokens_take_the_images_features_in_order_and_sampled_ids_stay_text(tower):
    from forge_rl.data import digit_sum
    from forge_rl.data.vision import load_processor
    from forge_rl.models.build_tiny_vlm import IMAGE_TOKEN_ID, IMAGE_TOKENS
    from forge_rl.models.vision_language import feature_map, image_pixels

    rows = list(itertools.islice(digit_sum.training_rows(seed=0), 2))
    first, second = (rows[0]["image"],), (rows[1]["image"],)
    images = image_pixels(load_processor(TINY_VLM).image_processor, [first, second, first])
    assert images.pixels.shape[0] == 2 and images.spans == [(0, 1), (1, 2), (0, 1)]  # each distinct image once
    with torch.no_grad():
        features = tower(images.pixels, images.attention_mask)
    tokens = torch.full((3, 3 + IMAGE_TOKENS), 5)
    tokens[:, 1 : 1 + IMAGE_TOKENS] = IMAGE_TOKEN_ID
    tokens[1, -1] = IMAGE_TOKEN_ID  # sampled by the model: text
    sampled = torch.zeros_like(tokens, dtype=torch.bool)
    sampled[:, -1] = True
    embeddings = torch.zeros(*tokens.shape, features.shape[-1])
    tower.show(images, feature_map(tokens, images, tower, sampled))
    with torch.no_grad():
        out = tower.embed_images(tokens, embeddings)
    for row, image in enumerate([0, 1, 0]):
        assert torch.equal(out[row, 1 : 1 + IMAGE_TOKENS], features[image])
    assert (out[:, 0] == 0).all() and (out[1, -1] == 0).all()
    with pytest.raises(
        ValueError, match=f"has {3 * IMAGE_TOKENS} image tokens and its 2 images make {2 * IMAGE_TOKENS}"
    ):
        feature_map(tokens, image_pixels(load_processor(TINY_VLM).image_processor, [first, second]), tower, sampled)
    with pytest.raises(ValueError, match="no images shown"):
        feature_map(tokens, None, tower, sampled)


def test_packed_image_rows_score_as_unpacked_and_other_images_never_share_a_prompt():
    """Shared-prompt packing of image rows: a group's rows share one copy of the prompt and its image tokens, which
    take the group's image's features through the packed places' sources. Two groups with the same prompt ids but
    other images stay apart. Logprobs and the tower's gradient are the unpacked ones (fp32, to rounding)."""
    from forge_rl.data import digit_sum
    from forge_rl.data.prompt_packing import plan_packing
    from tests.support.precision import vision_language_step

    packed, unpacked = (vision_language_step(share_prompts=share) for share in (True, False))
    unpacked.module.load_state_dict(packed.module.state_dict())
    rows = list(itertools.islice(digit_sum.reading_rows(seed=0), 2))
    tokens, mask, images = image_group_batch(packed, rows, group=3)
    assert len(plan_packing(tokens, mask, max_fraction=1.0, row_keys=images).tokens) == 2  # one row per image
    assert len(plan_packing(tokens, mask, max_fraction=1.0).tokens) == 1  # the same ids: one row without the images
    got, want = (step.logprobs(tokens, "none", mask, images=images)[0] for step in (packed, unpacked))
    assert packed.last_forward_tokens < unpacked.last_forward_tokens  # it did pack
    assert torch.allclose(got, want, atol=1e-5), float((got - want).abs().max())
    assert got[mask].abs().min() > 0 and not torch.allclose(got[:3], got[3:], atol=1e-3)  # the images do count
    (got.sum() + want.sum()).backward()  # two separate models: each takes its own gradient
    grads = [
        dict(s.module.vision.named_parameters())["connector.modality_projection.proj.weight"].grad
        for s in (packed, unpacked)
    ]
    assert torch.allclose(grads[0], grads[1], atol=1e-4) and grads[0].abs().sum() > 0


def image_group_batch(step, rows, group: int):
    """`group` responses to each row's image prompt, the prompts' ids the processor's expansion (the engine's)."""
    from forge_rl.data.images import load_image
    from forge_rl.data.vision import load_processor, render_image_prompt

    processor = load_processor(TINY_VLM)
    ids, prompts = [], []
    g = torch.Generator().manual_seed(0)
    for row in rows:
        text = render_image_prompt(processor, [{"role": "user", "content": row["prompt"]}], 1, "test")
        prompt = processor(text=[text], images=[[load_image(row["image"], "test")]], return_tensors="pt")["input_ids"][
            0
        ]
        prompts.append(prompt)
        ids += [torch.cat([prompt, torch.randint(3, 60, (4,), generator=g)]) for _ in range(group)]
    assert torch.equal(prompts[0], prompts[1])  # one text, two images: the same ids
    tokens = torch.stack(ids)
    mask = torch.zeros_like(tokens, dtype=torch.bool)
    mask[:, len(prompts[0]) :] = True
    return tokens, mask, [(row["image"],) for row in rows for _ in range(group)]
