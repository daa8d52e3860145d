"""Format reward with the TRL signature: the answer is digits only and the turn ended (EOS, not cut off)."""


def digits_format(prompts: list[str], completions: list[str], finish_reason: list[str], **_) -> list[float]:
    """1.0 when the completion is a non-empty run of digits and generation stopped on its own; else 0.0."""
    return [float(c.strip().isdigit() and f == "stop") for c, f in zip(completions, finish_reason, strict=True)]
