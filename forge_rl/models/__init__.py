"""Models: the embedded tiny model and the Qwen3 family in TorchTitan (forge_rl.models.qwen3)."""

import json
from pathlib import Path

from forge_rl.errors import ConfigError

TINY_MODEL_DIR = Path(__file__).parent / "tiny"
EMBEDDED = ("tiny", "tiny-warm", "tiny-teacher", "tiny-rm", "tiny-moe", "tiny-vlm")


def resolve_model_path(model: str) -> str:
    """ "tiny", "tiny-warm", "tiny-teacher", "tiny-rm", "tiny-moe", "tiny-vlm" -> the embedded models; anything
    else must be a local HF model directory (nothing is downloaded at run time)."""
    if model == "tiny":
        return str(TINY_MODEL_DIR)
    if model == "tiny-warm":  # the tiny model after SFT on arithmetic (configs/sft/tiny_warm.yaml)
        return str(Path(__file__).parent / "tiny_warm")
    if model == "tiny-rm":  # a reward model, p(the sum is right): forge_rl/models/build_tiny_rm.py, docs/tiny_model.md
        return str(Path(__file__).parent / "tiny_rm")
    if model == "tiny-moe":  # tiny-warm made a Qwen3-MoE (4 experts, top 2): forge_rl/models/build_tiny_moe.py
        return str(Path(__file__).parent / "tiny_moe")
    if model == "tiny-vlm":  # an Idefics3 vision-language model of the tiny model's size: build_tiny_vlm.py
        return str(Path(__file__).parent / "tiny_vlm")
    if model == "tiny-teacher":  # tiny-warm after `make demo`'s GRPO run: a stronger teacher for apps/distill
        return str(Path(__file__).parent / "tiny_teacher")
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model {model!r}: not 'tiny' and not a local HF model directory (no {path / 'config.json'}); "
            "forge_rl never downloads weights at run time, so pass a local path"
        )
    return str(path)


# What each role loads: the trainer trains Qwen3 (dense and MoE) as a causal LM; a reward model is a sequence
# classifier (one score per sequence); a critic is built on either (its head is replaced by a value head).
TRAINED_MODEL_TYPES = ("qwen3", "qwen3_moe")
# vision-language models the trainer builds (forge_rl/models/vision_language.py), and their language models: a
# decoder TorchTitan's Qwen3 builds (a Llama is one without the per-head q/k norms)
VISION_ARCHITECTURES = ("idefics3",)
TEXT_MODEL_TYPES = ("llama", "qwen3")
ROLE_HEADS = {
    "policy": ("ForCausalLM",),
    "reference": ("ForCausalLM",),
    "teacher": ("ForCausalLM",),
    "reward model": ("ForSequenceClassification",),
    "judge": ("ForCausalLM",),  # a reward model of kind judge: a causal LM on an engine of its own
    "critic": ("ForCausalLM", "ForSequenceClassification"),
}


def model_path(model: str, key: str = "model", role: str = "policy") -> str:
    """`resolve_model_path` for a config's `key`, checked before any actor loads it: a directory with an HF model
    config and weights, of an architecture the `role` (a key of ROLE_HEADS) can load. What is wrong is a
    ConfigError naming the key and what to give instead."""
    where = f"{key}={model!r}"
    fix = f"give a local HF model directory (config.json and weights) or one of {', '.join(EMBEDDED)}"
    if model not in EMBEDDED:
        path = Path(model).expanduser()
        if not path.exists():
            raise ConfigError(f"{where}: no such directory; {fix} (forge_rl never downloads weights at run time)")
        if not path.is_dir():
            raise ConfigError(f"{where} is a file, not a model directory; {fix}")
        if not (path / "config.json").is_file():
            raise ConfigError(f"{where}: no config.json in {path}, so not an HF model directory; {fix}")
    path = Path(resolve_model_path(model))
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{where}: {path / 'config.json'} is not readable JSON ({e}); {fix}") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise ConfigError(f"{where}: {path / 'config.json'} has no model_type, so it is not an HF model config; {fix}")
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        raise ConfigError(f"{where}: {path} has no weights (*.safetensors); {fix}")
    check_role(config, where, role)
    return str(path)


def check_role(config: dict, where: str, role: str) -> None:
    """A ConfigError when the HF config's architecture is not one the `role` loads (a reward model given as the
    policy, a model type the trainer does not build)."""
    heads = ROLE_HEADS[role]
    architectures = config.get("architectures") or []
    if "vision_config" in config and role not in ("reward model", "judge"):
        _check_vision_role(config, where, role, architectures)
        return
    if architectures and not any(a.endswith(head) for a in architectures for head in heads):
        wanted = " or ".join(f"a *{head} checkpoint" for head in heads)
        raise ConfigError(
            f"{where}: its config.json names architecture {', '.join(architectures)}, but the {role} needs {wanted}"
            + (
                " (a reward model goes under rewards: - model: ...)"
                if "ForSequenceClassification" in str(architectures)
                else ""
            )
        )
    if role not in ("reward model", "judge") and config.get("model_type") not in TRAINED_MODEL_TYPES:
        raise ConfigError(
            f"{where}: model_type {config.get('model_type')!r} is not one forge_rl trains "
            f"({', '.join(TRAINED_MODEL_TYPES)}); give a Qwen3 checkpoint"
        )


def _check_vision_role(config: dict, where: str, role: str, architectures: list[str]) -> None:
    """A vision-language model trains as the policy (and scores as its reference) when the trainer builds its
    architecture (forge_rl/models/vision_language.py); docs/vision.md."""
    named = ", ".join(architectures) or config.get("model_type")
    if role not in ("policy", "reference"):
        raise ConfigError(
            f"{where} is a vision-language model ({named}): it can be the policy and its reference, not the "
            f"{role} yet; give a text-only Qwen3 checkpoint (docs/vision.md)"
        )
    if why := check_trainable(config, where):
        raise ConfigError(f"{why} (docs/vision.md)")


def check_trainable(hf: dict, where: str) -> str | None:
    """Why the trainer cannot build this vision-language model (None: it can)."""
    if hf.get("model_type") not in VISION_ARCHITECTURES:
        return (
            f"{where}: the trainer builds vision-language models of type {', '.join(VISION_ARCHITECTURES)}, not "
            f"{hf.get('model_type')!r}"
        )
    text_type = hf.get("text_config", {}).get("model_type")
    if text_type not in TEXT_MODEL_TYPES:
        return f"{where}: its language model is {text_type!r}; the trainer builds {', '.join(TEXT_MODEL_TYPES)}"
    if text_type == "llama" and (hf["text_config"].get("attention_bias") or hf["text_config"].get("mlp_bias")):
        return f"{where}: its Llama language model has biases, which TorchTitan's decoder does not"
    return None


def load_tokenizer(model_dir: str, key: str = "model"):
    """The model's tokenizer (transformers), or a ConfigError naming `key` when the directory has none."""
    from forge_rl.deps.transformers import auto_tokenizer

    try:
        return auto_tokenizer(model_dir)
    except (OSError, ValueError, KeyError, TypeError) as e:
        why = " ".join(str(e).split())[:200]
        raise ConfigError(
            f"{key}: no tokenizer transformers can load in {model_dir} ({type(e).__name__}: {why}); "
            "an HF model directory holds its tokenizer files (tokenizer.json, tokenizer_config.json)"
        ) from None
