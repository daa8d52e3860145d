"""Models: the embedded tiny model and the Qwen3 family in TorchTitan (forge_rl.models.qwen3)."""

from pathlib import Path

TINY_MODEL_DIR = Path(__file__).parent / "tiny"


def resolve_model_path(model: str) -> str:
    """"tiny", "tiny-warm", "tiny-teacher", "tiny-rm" -> the embedded models; anything else must be a local HF model
    directory (nothing is downloaded at run time)."""
    if model == "tiny":
        return str(TINY_MODEL_DIR)
    if model == "tiny-warm":  # the tiny model after SFT on arithmetic (configs/sft/tiny_warm.yaml)
        return str(Path(__file__).parent / "tiny_warm")
    if model == "tiny-rm":  # a reward model, p(the sum is right): forge_rl/models/build_tiny_rm.py, docs/tiny_model.md
        return str(Path(__file__).parent / "tiny_rm")
    if model == "tiny-teacher":  # tiny-warm after `make demo`'s GRPO run: a stronger teacher for apps/distill
        return str(Path(__file__).parent / "tiny_teacher")
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model {model!r}: not 'tiny' and not a local HF model directory (no {path / 'config.json'}); "
            "forge_rl never downloads weights at run time, so pass a local path"
        )
    return str(path)
