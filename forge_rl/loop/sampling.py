"""The behaviour policy: which sampling settings the trainer can reproduce, read from one place.

The importance ratio compares the trainer's logprob of a token with the generator's recorded logprob.
Both must be of the same distribution: softmax(logits / temperature). The trainer therefore takes its
temperature from the generator's sampling config (never from a second setting).

Every vLLM SamplingParams field is classified here, once (tests/test_sampling.py enumerates vLLM's fields,
so a field a new vLLM release adds fails the test until it is classified):
- REPRODUCED: any value; it decides where a response ends or what comes back with it, never which token is
  drawn (temperature included: the trainer divides by the same one);
- SET_BY_GENERATOR: the generator sets it on every call (its logprobs and streaming depend on it);
- NEUTRAL: it changes the distribution in a way the trainer does not compute (truncation such as top_p,
  top_k and min_p, penalties, logit biases, banned or forced tokens, structured outputs, watermarking,
  logits processors through extra_args, a thinking budget that forces a token): allowed only at the value
  that leaves softmax(logits / T) unchanged.
Anything else is refused, as unknown. The run checks its config at start (`behaviour_temperature`); every
completion records the options it was sampled with (`Completion.sampling`), and the replay buffer refuses
an episode the trainer could not reproduce (`untrainable`), whoever called the generator. Evaluation calls
(greedy) may use any sampling: they are never trained on.
"""

from typing import Any

from forge_rl.errors import ConfigError, did_you_mean

REPRODUCED = frozenset({
    "temperature", "max_tokens", "stop", "stop_token_ids", "ignore_eos", "include_stop_str_in_output", "seed",
    "detokenize", "skip_special_tokens", "spaces_between_special_tokens", "stream_interval", "skip_clone",
    "output_text_buffer_length", "skip_reading_prefix_cache", "prompt_logprobs", "prompt_logprob_token_ids",
    "prompt_logprob_start", "logprob_token_ids", "trace_decode_token_ids", "routed_experts_prompt_start",
})
SET_BY_GENERATOR = frozenset({"n", "logprobs", "output_kind", "flat_logprobs"})
# option -> the values that leave softmax(logits / T) unchanged (vLLM SamplingParams names)
NEUTRAL: dict[str, tuple] = {
    "top_p": (1.0,),
    "top_k": (0, -1, None),
    "min_p": (0.0,),
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


def refusal(option: str, value: Any) -> str | None:
    """Why the trainer could not reproduce sampling with `option=value`, or None when it can."""
    if option in REPRODUCED:
        return None
    if option in SET_BY_GENERATOR:
        return f"{option} is set by the generator on every call; remove it"
    if option in NEUTRAL:
        if value in NEUTRAL[option]:
            return None
        return (f"{option}={value!r} changes the sampling distribution in a way the trainer does not reproduce, so "
                f"the importance ratios against the recorded behaviour logprobs would be wrong; remove it or set it "
                f"to {NEUTRAL[option][0]!r} ({TRAINS_ON})")
    close = did_you_mean(option, [*REPRODUCED, *NEUTRAL, *SET_BY_GENERATOR])
    return (f"{option} is not a vLLM SamplingParams option forge_rl has classified, so whether the trainer "
            f"reproduces it is unknown; " + (close or f"(forge_rl/loop/sampling.py; reproduced: {sorted(REPRODUCED)})"))


def behaviour_temperature(sampling: dict[str, Any], key: str = "generator.sampling") -> float:
    """The temperature of the behaviour policy that `sampling` (vLLM SamplingParams options) defines.

    Raises ConfigError naming the option when the trainer could not reproduce the distribution."""
    for option, value in sampling.items():
        if why := refusal(option, value):
            raise ConfigError(f"{key}.{why}")
    temperature = sampling.get("temperature", 1.0)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise ConfigError(f"{key}.temperature={temperature!r}: give a number > 0")
    if not temperature > 0:
        raise ConfigError(f"{key}.temperature={temperature}: training needs sampling with temperature > 0 "
                          "(greedy decoding has no logprobs to train on; evaluation is greedy already)")
    return float(temperature)


def untrainable(sampling: dict[str, Any] | None, temperature: float | None) -> str | None:
    """Why a completion sampled with `sampling` (as the generator recorded it) cannot be trained on by a trainer
    at `temperature` (None: any), or None when it can. A completion built by hand records nothing (None)."""
    if sampling is None:
        return None
    for option, value in sampling.items():
        if why := refusal(option, value):
            return why
    drawn_at = float(sampling.get("temperature", 1.0))
    if temperature is not None and drawn_at != temperature:
        return (f"temperature={drawn_at} differs from the trainer's {temperature} "
                f"(generator.sampling.temperature; {TRAINS_ON})")
    return None
