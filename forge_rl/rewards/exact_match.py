"""Exact-match reward with the TRL signature: reward(prompts, completions, **kwargs) -> list[float]."""


def exact_match(prompts: list[str], completions: list[str], answer: list[str], **_) -> list[float]:
    """1.0 when the completion, stripped of whitespace, equals the answer; else 0.0."""
    return [float(c.strip() == a.strip()) for c, a in zip(completions, answer, strict=True)]
