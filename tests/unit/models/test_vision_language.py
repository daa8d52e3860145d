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
    from forge_rl.models.vision_language import image_pixels

    rows = list(itertools.islice(digit_sum.training_rows(seed=0), 2))
    pixels, mask = image_pixels(load_processor(TINY_VLM).image_processor, [(rows[0]["image"],), (rows[1]["image"],)])
    assert pixels.shape[0] == 2
    with torch.no_grad():
        features = tower(pixels, mask)
    tokens = torch.full((2, 3 + IMAGE_TOKENS), 5)
    tokens[:, 1 : 1 + IMAGE_TOKENS] = IMAGE_TOKEN_ID
    tokens[1, -1] = IMAGE_TOKEN_ID  # sampled by the model: text
    sampled = torch.zeros_like(tokens, dtype=torch.bool)
    sampled[:, -1] = True
    embeddings = torch.zeros(*tokens.shape, features.shape[-1])
    tower.show(pixels, mask, sampled=sampled)
    with torch.no_grad():
        out = tower.embed_images(tokens, embeddings)
    assert torch.equal(out[0, 1 : 1 + IMAGE_TOKENS], features[0]) and torch.equal(
        out[1, 1 : 1 + IMAGE_TOKENS], features[1]
    )
    assert (out[:, 0] == 0).all() and (out[1, -1] == 0).all()
    tower.show(pixels[:1], mask[:1], sampled=sampled)
    with pytest.raises(ValueError, match=f"has {2 * IMAGE_TOKENS} image tokens and its 1 images make {IMAGE_TOKENS}"):
        tower.embed_images(tokens, embeddings)
    tower.show(None)
    with pytest.raises(ValueError, match="no images shown"):
        tower.embed_images(tokens, embeddings)
