"""The behaviour policy: which sampling settings the trainer can reproduce, read from one place.

The importance ratio compares the trainer's logprob of a token with the generator's recorded logprob.
Both must be of the same distribution: softmax(logits / temperature). The trainer therefore takes its
temperature from the generator's sampling config (never from a second setting).

Every vLLM SamplingParams field is classified here, once (tests/unit/loop/test_sampling.py enumerates vLLM's fields,
so a field a new vLLM release adds fails the test until it is classified):
- REPRODUCED: any value; it decides where a response ends or what comes back with it, never which token is
  drawn (temperature included: the trainer divides by the same one);
- SET_BY_GENERATOR: the generator sets it on every call (its logprobs and streaming depend on it);
- KEPT_SET: truncation (top_p, top_k, min_p, alone or combined): any value. Each token is drawn from a subset
  of the vocabulary, its kept set; the generator records that set with the token (Completion.kept_ids, at most
  generator.max_kept_tokens ids) and the trainer renormalises over it (Keep Sampling Mask, docs/algorithms.md).
  A sample with a larger set is not recorded, and cannot be trained on (counted: sampling_mask_over_cap);
- NEUTRAL: it changes the distribution in a way the trainer does not compute (penalties, logit biases, banned
  or forced tokens, structured outputs, watermarking, logits processors through extra_args, a thinking budget
  that forces a token): allowed only at the value that leaves softmax(logits / T) unchanged.
Anything else is refused, as unknown. The run checks its config at start (`behaviour_temperature`); every
completion records the options it was sampled with (`Completion.sampling`), and the replay buffer refuses
an episode the trainer could not reproduce (`untrainable`), whoever called the generator. Evaluation calls
(greedy) may use any sampling: they are never trained on.
"""

import math
from typing import Any

from forge_rl.errors import ConfigError, did_you_mean

REPRODUCED = frozenset(
    {
        "temperature",
        "max_tokens",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "include_stop_str_in_output",
        "seed",
        "detokenize",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "stream_interval",
        "skip_clone",
        "output_text_buffer_length",
        "skip_reading_prefix_cache",
        "prompt_logprobs",
        "prompt_logprob_token_ids",
        "prompt_logprob_start",
        "logprob_token_ids",
        "trace_decode_token_ids",
        "routed_experts_prompt_start",
    }
)
SET_BY_GENERATOR = frozenset({"n", "logprobs", "output_kind", "flat_logprobs"})
# truncation, reproduced over the recorded kept set: option -> the values that truncate nothing
KEPT_SET: dict[str, tuple] = {"top_p": (1.0,), "top_k": (0, -1, None), "min_p": (0.0,)}
# option -> the values that leave softmax(logits / T) unchanged (vLLM SamplingParams names)
NEUTRAL: dict[str, tuple] = {
    "repetition_penalty": (1.0,),
    "presence_penalty": (0.0,),
    "frequency_penalty": (0.0,),
    "logit_bias": (None, {}),
    "allowed_token_ids": (None, []),
    "bad_words": (None, []),
    "min_tokens": (0,),
    "structured_outputs": (None,),
    "watermarking": (None,),
    "extra_args": (None, {}),
    "thinking_token_budget": (None,),
    "repetition_detection": (None,),
}
TRAINS_ON = "training samples softmax(logits / temperature)"


def truncation(sampling: dict[str, Any]) -> dict[str, Any]:
    """The options of `sampling` that truncate the distribution (top_p, top_k, min_p not at their neutral values):
    a token drawn with them needs its kept set recorded to be reproduced."""
    return {k: v for k, v in sampling.items() if k in KEPT_SET and v not in KEPT_SET[k]}


def refusal(option: str, value: Any) -> str | None:
    """Why the trainer could not reproduce sampling with `option=value`, or None when it can."""
    if option in REPRODUCED or option in KEPT_SET:
        return None
    if option in SET_BY_GENERATOR:
        return f"{option} is set by the generator on every call; remove it"
    if option in NEUTRAL:
        if value in NEUTRAL[option]:
            return None
        return (
            f"{option}={value!r} changes the sampling distribution in a way the trainer does not reproduce, so "
            f"the importance ratios against the recorded behaviour logprobs would be wrong; remove it or set it "
            f"to {NEUTRAL[option][0]!r} ({TRAINS_ON})"
        )
    close = did_you_mean(option, [*REPRODUCED, *KEPT_SET, *NEUTRAL, *SET_BY_GENERATOR])
    return (
        f"{option} is not a vLLM SamplingParams option forge_rl has classified, so whether the trainer "
        f"reproduces it is unknown; " + (close or f"(forge_rl/loop/sampling.py; reproduced: {sorted(REPRODUCED)})")
    )


def behaviour_temperature(
    sampling: dict[str, Any], key: str = "generator.sampling", max_kept_tokens: int | None = None
) -> float:
    """The temperature of the behaviour policy that `sampling` (vLLM SamplingParams options) defines.

    Raises ConfigError naming the option when the trainer could not reproduce the distribution, or when a top_k
    keeps more ids than the generator records (`max_kept_tokens`, generator.max_kept_tokens)."""
    for option, value in sampling.items():
        if why := refusal(option, value):
            raise ConfigError(f"{key}.{why}")
    if why := top_k_over_cap(sampling, max_kept_tokens):
        raise ConfigError(f"{key}.{why}")
    temperature = sampling.get("temperature", 1.0)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise ConfigError(f"{key}.temperature={temperature!r}: give a number > 0")
    if not temperature > 0:
        raise ConfigError(
            f"{key}.temperature={temperature}: training needs sampling with temperature > 0 "
            "(greedy decoding has no logprobs to train on; evaluation is greedy already)"
        )
    return float(temperature)


def top_k_over_cap(sampling: dict[str, Any], max_kept_tokens: int | None) -> str | None:
    """Why `sampling`'s top_k cannot be recorded (it keeps more ids than `max_kept_tokens`), or None."""
    top_k = truncation(sampling).get("top_k")
    if max_kept_tokens is None or top_k is None or not isinstance(top_k, int) or top_k <= max_kept_tokens:
        return None
    return (
        f"top_k={top_k} keeps more tokens than the generator records per token (generator.max_kept_tokens="
        f"{max_kept_tokens}), so no sample could be trained on; lower top_k or raise generator.max_kept_tokens"
    )


def untrainable(
    sampling: dict[str, Any] | None, temperature: float | None, kept_recorded: bool = False, over_cap: int = 0
) -> str | None:
    """Why a completion sampled with `sampling` (as the generator recorded it) cannot be trained on by a trainer
    at `temperature` (None: any), or None when it can. A completion built by hand records nothing (None).
    `kept_recorded`: the completion holds its tokens' kept sets; `over_cap`: how many of its tokens had a kept
    set larger than the generator records (then none is recorded)."""
    if sampling is None:
        return None
    for option, value in sampling.items():
        if why := refusal(option, value):
            return why
    if (cut := truncation(sampling)) and not kept_recorded:
        drawn = ", ".join(f"{k}={v!r}" for k, v in cut.items())
        if over_cap:
            return (
                f"{over_cap} of its tokens were drawn ({drawn}) from more tokens than the generator records "
                f"(generator.max_kept_tokens), so the trainer cannot renormalise over their kept sets"
            )
        return (
            f"it was drawn with {drawn} and carries no sampling mask (Completion.kept_ids), so the trainer "
            "cannot renormalise over the tokens it was drawn from"
        )
    drawn_at = float(sampling.get("temperature", 1.0))
    if temperature is not None and drawn_at != temperature:
        return (
            f"temperature={drawn_at} differs from the trainer's {temperature} "
            f"(generator.sampling.temperature; {TRAINS_ON})"
        )
    return None


def check_sampling_values(sampling: dict[str, Any], key: str = "generator.sampling") -> None:
    """vLLM's own validation of `sampling` (its SamplingParams), in the controller before any engine starts, its
    refusal re-worded to name the config key: `generator.sampling.top_p=1.5: top_p must be in (0, 1]`. Each option
    is tried alone first, so the one vLLM refuses is named; then together (options that only conflict as a set).
    Without vLLM in this process (a controller on a host that runs no engine) the generator checks them at start.
    Plainly valid options (`plainly_valid`) are not given to vLLM."""
    import logging

    if plainly_valid(sampling):
        return
    logging.disable(logging.WARNING)  # vLLM's import-time warnings would add lines to a one-line error
    try:
        from vllm.sampling_params import SamplingParams
    except ImportError:
        return
    finally:
        logging.disable(logging.NOTSET)
    for option, value in sampling.items():
        if why := _refused_by_vllm(SamplingParams, {option: value}):
            raise ConfigError(f"{key}.{option}={value!r}: {why}")
    if why := _refused_by_vllm(SamplingParams, sampling):
        raise ConfigError(f"{key} {dict(sampling)}: {why}")


def plainly_valid(sampling: dict[str, Any]) -> bool:
    """Whether `sampling` sets at most a finite temperature > 0 and an integer max_tokens >= 1: values vLLM takes,
    so checking them needs no vLLM (whose import takes seconds of a run's start)."""
    temperature, max_tokens = sampling.get("temperature", 1.0), sampling.get("max_tokens", 16)
    return (
        set(sampling) <= {"temperature", "max_tokens"}
        and isinstance(temperature, (int, float))
        and not isinstance(temperature, bool)
        and math.isfinite(temperature)
        and temperature > 0
        and isinstance(max_tokens, int)
        and not isinstance(max_tokens, bool)
        and max_tokens >= 1
    )


def _refused_by_vllm(params: type, options: dict[str, Any]) -> str | None:
    try:
        params(**options)
    except Exception as e:  # VLLMValidationError for a value out of range, TypeError for one of the wrong type
        said = " ".join(str(e).split()).split(" (parameter=")[0] or type(e).__name__
        return f"not a value of the type vLLM's SamplingParams takes ({said})" if isinstance(e, TypeError) else said
    return None
