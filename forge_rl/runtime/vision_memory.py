"""A vision-language model's vision tower in the memory plan (forge_rl/runtime/memory_plan.py): its parameters, and
the activations of the image tiles a micro-batch's image tokens stand for (Idefics3: SigLIP's encoder layers and
the connector's pixel shuffle, `scale_factor`^2 patches an image token).

    vision_shape(config)   # ModelShape's vision fields: parameters, encoder layers, a layer's bytes per image token
"""


def vision_shape(config: dict) -> dict:
    """The vision fields of memory_plan.ModelShape for the Idefics3 config.json `config`."""
    return dict(
        vision_parameters=vision_parameters(config),
        vision_layers=config["vision_config"]["num_hidden_layers"],
        vision_layer_bytes=vision_layer_bytes(config),
    )


def vision_parameters(config: dict) -> int:
    """An Idefics3 vision tower's parameters (SigLIP's: patch and position embeddings, pre-norm layers with biases, a
    final LayerNorm) and its connector's (one linear from the pixel-shuffled width to the language model's)."""
    v = config["vision_config"]
    h, inner, patch = v["hidden_size"], v["intermediate_size"], v["patch_size"]
    embeddings = 3 * patch * patch * h + h + (v["image_size"] // patch) ** 2 * h
    layer = 4 * (h * h + h) + 2 * h * inner + inner + h + 4 * h
    connector = h * config.get("scale_factor", 1) ** 2 * config["text_config"]["hidden_size"]
    return embeddings + v["num_hidden_layers"] * layer + 2 * h + connector


def vision_layer_bytes(config: dict) -> int:
    """What one encoder layer holds per image token in bf16, for the scale_factor^2 patches the token stands for:
    attention's q, k, v and output (4 x width) and the MLP's intermediate before and after its activation
    (2 x intermediate). A frozen tower holds one layer's at a time (nothing is kept for a backward); a trained one
    keeps each layer's for its backward (no activation checkpointing in the tower)."""
    v = config["vision_config"]
    return config.get("scale_factor", 1) ** 2 * (4 * v["hidden_size"] + 2 * v["intermediate_size"]) * 2


def tower_frozen(freeze: list[str]) -> bool:
    """Whether trainer.freeze's `freeze` holds the whole vision tower (`vision` or `vision.vision_model`)."""
    return any("vision.vision_model.".startswith(name + ".") for name in freeze)
