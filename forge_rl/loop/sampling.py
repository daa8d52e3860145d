"""The behaviour policy: which sampling settings the trainer can reproduce, read from one place.

The importance ratio compares the trainer's logprob of a token with the generator's recorded logprob.
Both must be of the same distribution: softmax(logits / temperature). The trainer therefore takes its
temperature from the generator's sampling config (never from a second setting), and sampling options
that change the distribution in ways the trainer does not compute (truncation such as top_p, top_k and
min_p, penalties, logit biases, banned or forced tokens) are refused at start, before any actor exists.
"""

from typing import Any

# option -> the value that leaves softmax(logits / T) unchanged (vLLM SamplingParams names)
NEUTRAL: dict[str, Any] = {
    "top_p": 1.0,
    "top_k": (0, -1, None),
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "logit_bias": (None, {}),
    "allowed_token_ids": (None, []),
    "bad_words": (None, []),
    "min_tokens": 0,
}


def behaviour_temperature(sampling: dict[str, Any], key: str = "generator.sampling") -> float:
    """The temperature of the behaviour policy that `sampling` (vLLM SamplingParams options) defines.

    Raises ValueError naming the option when the trainer could not reproduce the distribution."""
    for option, neutral in NEUTRAL.items():
        if option not in sampling:
            continue
        value = sampling[option]
        allowed = neutral if isinstance(neutral, tuple) else (neutral,)
        if value not in allowed:
            raise ValueError(
                f"{key}.{option}={value!r} changes the sampling distribution in a way the trainer does not "
                f"reproduce, so the importance ratios against the recorded behaviour logprobs would be wrong; "
                f"remove it or set it to {allowed[0]!r} (training samples softmax(logits / temperature))"
            )
    temperature = float(sampling.get("temperature", 1.0))
    if temperature <= 0:
        raise ValueError(f"{key}.temperature={temperature}: training needs sampling with temperature > 0 "
                         "(greedy decoding has no logprobs to train on)")
    return temperature
