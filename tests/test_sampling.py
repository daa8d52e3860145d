"""One behaviour policy: the trainer's temperature comes from the sampling config, and sampling options
the trainer cannot reproduce are refused at start with an error that names them."""

import pytest

from forge_rl.recipes.grpo_config import GRPOConfig, check_config
from forge_rl.config import ConfigError, load_config
from forge_rl.loop.sampling import NEUTRAL, behaviour_temperature
from tests.conftest import REPO

NOT_REPRODUCED = {
    "top_p": 0.8, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "presence_penalty": 0.5,
    "frequency_penalty": 0.5, "logit_bias": {5: 2.0}, "allowed_token_ids": [5, 6], "bad_words": ["7"],
    "min_tokens": 3,
}


def test_every_refused_option_is_listed():
    assert set(NOT_REPRODUCED) == set(NEUTRAL)


@pytest.mark.parametrize("option", sorted(NOT_REPRODUCED))
def test_options_the_trainer_cannot_reproduce_are_refused_by_name(option):
    with pytest.raises(ValueError, match=rf"generator\.sampling\.{option}="):
        behaviour_temperature({"temperature": 0.7, option: NOT_REPRODUCED[option]})


@pytest.mark.parametrize("option", sorted(NEUTRAL))
def test_neutral_values_are_accepted(option):
    neutral = NEUTRAL[option]
    value = neutral[0] if isinstance(neutral, tuple) else neutral
    assert behaviour_temperature({"temperature": 0.7, option: value}) == 0.7


def test_greedy_sampling_cannot_be_trained_on():
    with pytest.raises(ValueError, match="temperature > 0"):
        behaviour_temperature({"temperature": 0.0})


def grpo(*overrides: str) -> GRPOConfig:
    return load_config(GRPOConfig, REPO / "configs/grpo/tiny.yaml", list(overrides))


def test_trainer_reads_the_sampling_temperature():
    cfg = grpo("generator.sampling.temperature=0.7")  # the override the docs show
    check_config(cfg)
    assert cfg.trainer.temperature == 0.7


def test_a_second_temperature_that_disagrees_is_an_error_naming_both_keys():
    cfg = grpo("generator.sampling.temperature=0.7", "trainer.temperature=1.0")
    with pytest.raises(ConfigError, match=r"trainer\.temperature=1\.0.*generator\.sampling\.temperature=0\.7"):
        check_config(cfg)


def test_raw_logprobs_mode_is_refused():
    cfg = grpo("generator.engine_args.logprobs_mode=raw_logprobs")
    with pytest.raises(ConfigError, match="logprobs_mode"):
        check_config(cfg)


def test_top_p_in_the_grpo_config_fails_before_any_actor_starts():
    cfg = grpo("generator.sampling.top_p=0.8")
    with pytest.raises(ValueError, match="top_p"):
        check_config(cfg)
