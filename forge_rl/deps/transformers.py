"""Loading a Qwen3 tokenizer without importing transformers' Auto classes.

`from transformers import AutoTokenizer` imports torch and every model family's configuration (seconds of
CPU on a small machine; the tokenizer class alone, without torch, a fraction of that). The run's controller, its dataset
role and its reward role each load the policy's tokenizer at start-up, so `auto_tokenizer` picks the class
AutoTokenizer would pick for the model types forge_rl trains, and calls AutoTokenizer itself for anything else.

The choice mirrors `AutoTokenizer.from_pretrained` of transformers 5.19 (read from its source; pyproject.toml allows
5.16-5.19, and the test below compares the two on whichever release is installed) for a local directory: a qwen3 or
qwen3_moe config, no remote code (`auto_map` in tokenizer_config.json), and a `tokenizer_class` of
- Qwen2Tokenizer(Fast): that class (the one the model type registers);
- PreTrainedTokenizerFast or TokenizersBackend: TokenizersBackend (the generic class the hub names is trusted for
  these model types, and resolves to the tokenizers backend).
tests/unit/deps/test_deps.py loads every shipped model and a folder naming each class both ways and compares them.
"""

import json
from pathlib import Path

QWEN3_MODEL_TYPES = ("qwen3", "qwen3_moe")
GENERIC_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")
QWEN2_CLASSES = ("Qwen2Tokenizer", "Qwen2TokenizerFast")


def direct_tokenizer_class(model_dir: str | Path) -> str | None:
    """The class AutoTokenizer would instantiate for `model_dir` when it is one of the cases above, else None."""
    folder = Path(model_dir)
    try:
        config = json.loads((folder / "config.json").read_text())
        tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None  # AutoTokenizer says what is missing or malformed
    if not isinstance(config, dict) or not isinstance(tokenizer_config, dict):
        return None
    if config.get("model_type") not in QWEN3_MODEL_TYPES or "auto_map" in tokenizer_config:
        return None
    named = tokenizer_config.get("tokenizer_class")
    if named in QWEN2_CLASSES:
        return "Qwen2Tokenizer"
    if named in GENERIC_CLASSES:
        return "TokenizersBackend"
    return None


def auto_tokenizer(model_dir: str | Path, **kwargs):
    """What `AutoTokenizer.from_pretrained(model_dir, **kwargs)` returns, without the Auto import where the
    directory is a Qwen3 model's (above)."""
    name = direct_tokenizer_class(model_dir)
    if name is None:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(model_dir), **kwargs)
    import transformers

    # _from_auto: what AutoTokenizer passes to the class it picked (the same warnings and defaults follow)
    return getattr(transformers, name).from_pretrained(str(model_dir), _from_auto=True, **kwargs)


def idefics3_vision_modules(hf: dict):
    """transformers' Idefics3 vision encoder and connector for the HF config `hf` (a dict of config.json), with no
    weights loaded: (Idefics3VisionTransformer, Idefics3Connector). The trainer's vision-language model puts them in
    front of TorchTitan's decoder (forge_rl/models/vision_language.py). Attention is SDPA, as the engine's."""
    from transformers import Idefics3Config
    from transformers.models.idefics3.modeling_idefics3 import Idefics3Connector, Idefics3VisionTransformer

    config = Idefics3Config(**{k: v for k, v in hf.items() if k not in ("architectures", "torch_dtype")})
    config.vision_config._attn_implementation = "sdpa"
    return Idefics3VisionTransformer(config.vision_config), Idefics3Connector(config)


def auto_processor(model_dir: str | Path):
    """`AutoProcessor.from_pretrained(model_dir)`, without the warning transformers 5.19 logs once per process while
    loading an Idefics3 processor: on the way it builds a default Idefics3 config, whose default language model's
    pad_token_id (128002) is outside that default's vocabulary. The model's own config is not the one checked."""
    import logging

    from transformers import AutoProcessor

    def not_the_default_configs_warning(record: logging.LogRecord) -> bool:
        return "must be `None` or an integer within the vocabulary" not in record.getMessage()

    log = logging.getLogger("transformers.configuration_utils")
    log.addFilter(not_the_default_configs_warning)
    try:
        return AutoProcessor.from_pretrained(str(model_dir))
    finally:
        log.removeFilter(not_the_default_configs_warning)
