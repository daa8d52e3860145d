"""generator.lengths (drawn long-tailed response lengths), the filler split of a response that ran past its end,
partial-rollout counting and stale_in_flight's config checks: no processes."""

import statistics

import pytest
import torch
from transformers import AutoTokenizer

from forge_rl.actors.generator_outputs import filler_completion
from forge_rl.errors import ConfigError
from forge_rl.loop.lengths import LengthDraws, ResponseLengthsConfig
from forge_rl.loop.rollout import RolloutStats
from forge_rl.models import model_path
from forge_rl.recipes.grpo_checks import check_single_turn_options
from forge_rl.recipes.grpo_config import GRPOConfig
from forge_rl.types import Completion


def test_drawn_lengths_have_the_asked_median_and_tail_and_each_example_keeps_its_own():
    draws = LengthDraws(ResponseLengthsConfig(median=40, p99_over_median=9, seed=3), max_tokens=100_000)
    lengths = sorted(draws.length(f"ex-{i}") for i in range(20_000))
    p50, p99 = lengths[len(lengths) // 2], lengths[int(0.99 * len(lengths))]
    assert 38 <= p50 <= 42 and 8.0 <= p99 / p50 <= 10.0, (p50, p99)
    assert statistics.mean(lengths) > 1.4 * p50  # a heavy right tail
    again = LengthDraws(ResponseLengthsConfig(median=40, p99_over_median=9, seed=3), max_tokens=100_000)
    other = LengthDraws(ResponseLengthsConfig(median=40, p99_over_median=9, seed=4), max_tokens=100_000)
    ids = [f"ex-{i}" for i in range(50)]
    assert [draws.length(i) for i in ids] == [again.length(i) for i in reversed(ids)][::-1]  # whatever the order
    assert [draws.length(i) for i in ids] != [other.length(i) for i in ids]


def test_drawn_lengths_stay_within_min_tokens_and_max_tokens():
    draws = LengthDraws(ResponseLengthsConfig(median=12, p99_over_median=9, min_tokens=8, seed=0), max_tokens=112)
    lengths = [draws.length(str(i)) for i in range(5_000)]
    assert min(lengths) == 8 and max(lengths) == 112
    assert draws.sampling("7") == dict(max_tokens=draws.length("7"), filler_after_eos=True)


@pytest.mark.parametrize(
    "lengths, match",
    [
        (ResponseLengthsConfig(median=200), "median \\(200\\) <= generator.sampling.max_tokens \\(128\\)"),
        (ResponseLengthsConfig(median=10, min_tokens=20), "min_tokens \\(20\\) <= median \\(10\\)"),
        (ResponseLengthsConfig(median=10, p99_over_median=0.5), "p99_over_median=0.5 must be >= 1"),
    ],
)
def test_lengths_that_cannot_be_drawn_are_refused_naming_the_key(lengths, match):
    cfg = GRPOConfig()
    cfg.generator.sampling["max_tokens"] = 128
    cfg.generator.lengths = lengths
    with pytest.raises(ConfigError, match=match):
        check_single_turn_options(cfg)


def test_lengths_refuse_overlong_and_environments_and_stale_in_flight_takes_two_values():
    cfg = GRPOConfig()
    cfg.generator.sampling["max_tokens"] = 64
    cfg.generator.lengths = ResponseLengthsConfig(median=16)
    cfg.overlong.filter = True
    with pytest.raises(ConfigError, match="overlong"):
        check_single_turn_options(cfg)
    cfg.overlong.filter = False
    cfg.env.name = "retry"
    with pytest.raises(ConfigError, match="generator.lengths applies to single-turn rollouts"):
        check_single_turn_options(cfg)
    cfg.generator.lengths = ResponseLengthsConfig()
    cfg.stale_in_flight = "requeue"
    with pytest.raises(ConfigError, match="stale_in_flight=requeue applies to single-turn"):
        check_single_turn_options(cfg)
    with pytest.raises(ValueError, match="stale_in_flight='drop'; choose one of \\('finish', 'requeue'\\)"):
        GRPOConfig(stale_in_flight="drop")


def completion(ids: list[int], versions: list[int] | None = None) -> Completion:
    n = len(ids)
    return Completion(
        prompt_ids=torch.tensor([5, 6]),
        response_ids=torch.tensor(ids),
        logprobs=torch.full((n,), -0.5),
        policy_versions=torch.tensor(versions or [0] * n),
        finish_reason="length",
        text="not yet split",
    )


def test_filler_after_the_first_end_of_sequence_token_is_masked_and_out_of_the_text():
    tokenizer = AutoTokenizer.from_pretrained(model_path("tiny-warm"))
    eos = tokenizer.eos_token_id
    answer = tokenizer("46", add_special_tokens=False)["input_ids"]
    ran_on = completion(answer + [eos] + [3, 3, eos, 7])
    c = filler_completion(ran_on, {eos}, tokenizer)
    assert c.text == "46" and c.finish_reason == "stop"
    assert c.env_mask.tolist() == [False] * (len(answer) + 1) + [True] * 4  # the EOS itself is the model's action
    assert torch.equal(c.response_ids, ran_on.response_ids) and torch.equal(c.logprobs, ran_on.logprobs)
    ended = filler_completion(completion(answer + [eos]), {eos}, tokenizer)
    assert ended.env_mask is None and ended.text == "46" and ended.finish_reason == "stop"
    never = filler_completion(completion(answer + [3, 3]), {eos}, tokenizer)
    assert never.finish_reason == "length" and never.env_mask is None


def test_tokens_made_after_a_swap_mid_sequence_are_counted():
    stats = RolloutStats()
    stats.count_versions(
        [
            completion([1, 2, 3, 4], [3, 3, 4, 4]),
            completion([1, 2, 3], [3, 3, 3]),
            completion([1, 2, 3, 4, 5], [2, 3, 3, 4, 4]),
        ]
    )
    assert stats.partial_rollouts() == dict(
        sequences=3, swapped_sequences=2, swapped_tokens=2 + 4, requeued_groups=0, requeued_tokens=0
    )
