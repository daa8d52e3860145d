"""The embedded tiny VLM (forge_rl/models/build_tiny_vlm.py, warm-started by forge_rl/models/warm_tiny_vlm.py): its
script rebuilds the shipped processor and config files bit for bit, the shipped weights are the same tensors warm,
it reads the digits of some held-out images (the demo's starting point) and it stays small enough to ship."""

from pathlib import Path

from safetensors import safe_open

from forge_rl.models import resolve_model_path
from forge_rl.models.build_tiny_vlm import build


def test_the_script_rebuilds_the_shipped_files_and_the_warm_weights_are_its_tensors(tmp_path):
    shipped = Path(resolve_model_path("tiny-vlm"))
    built = build(tmp_path / "tiny_vlm")
    names = sorted(p.name for p in built.iterdir())
    assert names == sorted(p.name for p in shipped.iterdir())
    for name in names:
        if name != "model.safetensors":
            assert (built / name).read_bytes() == (shipped / name).read_bytes(), name
    with safe_open(built / "model.safetensors", "pt") as random, safe_open(shipped / "model.safetensors", "pt") as warm:
        assert sorted(random.keys()) == sorted(warm.keys())
        for key in random.keys():
            assert random.get_slice(key).get_shape() == warm.get_slice(key).get_shape(), key
        moved = [key for key in random.keys() if not random.get_tensor(key).equal(warm.get_tensor(key))]
    assert any("vision_model" in key for key in moved) and any("text_model" in key for key in moved)
    assert sum((built / name).stat().st_size for name in names) < 5 << 20


def test_the_shipped_weights_read_the_digits_of_some_held_out_images():
    from forge_rl.models.warm_tiny_vlm import greedy_accuracy, load, sft_batch

    model, processor, _, held_out = load(Path(resolve_model_path("tiny-vlm")))
    accuracy = greedy_accuracy(model.eval(), sft_batch(processor, held_out, model.config.text_config.pad_token_id))
    assert 0.15 <= accuracy <= 0.6  # warm, with room left for GRPO (random weights: 0%)
