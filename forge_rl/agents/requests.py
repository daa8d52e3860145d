"""What an OpenAI request may ask of the run's generators, and the generate call it becomes.

A training episode's tokens are trained on, so its calls sample as the run trains: `temperature`, `top_p`, `top_k`
and `min_p` are the run's (generator.sampling); a request that sends another value is refused naming the field,
since the trainer's logprobs must be of the distribution that sampled. Options that change the distribution in a
way the trainer does not reproduce (penalties, logit biases, banned tokens) are refused as forge_rl/loop/sampling.py
says; options that only decide where a reply ends (`stop`, `seed`, `max_tokens`, ...) are honoured. An evaluation
episode is never trained on: it samples greedily unless the request says otherwise, and any sampling is allowed.

A field this endpoint does not serve (streaming, beam search, structured outputs, top logprobs, ...) is refused by
name rather than ignored. `max_tokens` is capped by the run's generator.sampling.max_tokens and by the room the
prompt leaves in the engine's max_model_len.
"""

from typing import Any

from forge_rl.agents.episodes import Refused
from forge_rl.loop.sampling import KEPT_SET, refusal

# the run's sampler: a training call must sample with the run's values of these
SAMPLER = ("temperature", "top_p", "top_k", "min_p")
# OpenAI/vLLM request fields that become vLLM SamplingParams options of the generate call, under the same name
PASSED = (
    "stop",
    "stop_token_ids",
    "seed",
    "ignore_eos",
    "include_stop_str_in_output",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "allowed_token_ids",
    "bad_words",
    "min_tokens",
)
# fields read by the endpoint itself (or harmless: ids, user names)
READ = (
    "model",
    "messages",
    "prompt",
    "max_tokens",
    "max_completion_tokens",
    "n",
    "logprobs",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "chat_template_kwargs",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "return_token_ids",
    "stream",
    "user",
    "request_id",
    "session_id",
    "add_special_tokens",
    "echo",
)
NEUTRAL_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": None, "min_p": 0.0}


def _same_sampler(name: str, asked: Any, run: Any) -> bool:
    if name in KEPT_SET and asked in KEPT_SET[name] and run in KEPT_SET[name]:
        return True  # both truncate nothing (top_k 0, -1 and None alike)
    return asked == run


def generate_options(request, run_sampling: dict, mode: str) -> dict[str, Any]:
    """The generate call's vLLM SamplingParams options (max_tokens aside) for `request`; Refused (reason
    "agent_request") naming the first field that cannot be served. `mode`: "train" (a training episode: the run's
    sampler), "eval" (an evaluation episode: greedy unless asked otherwise) or "free" (the root URL, never
    recorded: the run's sampling unless asked otherwise)."""
    fields = request.model_fields_set
    for name in sorted(fields):
        if name not in SAMPLER and name not in PASSED and name not in READ:
            refuse(f"{name} is not served by forge_rl's endpoint; leave it out")
    if request.stream:
        refuse("stream=true is not served; call without streaming")
    if getattr(request, "echo", False):
        refuse("echo=true is not served")
    if (n := request.n or 1) < 1:
        refuse(f"n={n}: ask for at least one choice")
    options = {name: getattr(request, name) for name in PASSED if name in fields and getattr(request, name) is not None}
    if "logit_bias" in options:
        options["logit_bias"] = {int(k): v for k, v in options["logit_bias"].items()}
    asked = {name: getattr(request, name) for name in SAMPLER if name in fields and getattr(request, name) is not None}
    if mode == "eval":  # never trained on: greedy unless asked otherwise
        return {"temperature": 0.0, **options, **asked}
    if mode == "free":
        return {**options, **asked}
    for name, value in asked.items():
        run = run_sampling.get(name, NEUTRAL_DEFAULTS[name])
        if not _same_sampler(name, value, run):
            refuse(
                f"{name}={value} differs from the run's generator.sampling.{name}={run}: a training episode samples "
                "as the run trains (the trainer's logprobs must be of the distribution that sampled); leave it out"
            )
    for name, value in options.items():
        if why := refusal(name, value):
            refuse(why)
    return options


def max_tokens(asked: int | None, run_max: int, prompt_len: int, max_model_len: int) -> int:
    """The reply's token budget: what the request asks for, at most the run's and the room left in the engine."""
    room = max_model_len - prompt_len
    if room < 1:
        raise Refused(
            "prompt_too_long",
            f"a prompt of {prompt_len} tokens leaves no room for a reply in the engine's max_model_len={max_model_len}",
        )
    if asked is not None and asked < 1:
        refuse(f"max_tokens={asked}: ask for at least one token")
    return min(asked or run_max, run_max, room)


def refuse(message: str) -> None:
    raise Refused("agent_request", message)
