"""One behaviour policy: every vLLM sampling option is classified (reproduced by the trainer, reproduced over the
recorded kept set, set by the generator, or allowed only at its neutral value); the run refuses the others at start
naming them, and the replay buffer refuses episodes drawn with them, whoever called the generator."""

import pytest
import torch

from forge_rl.actors.replay_buffer import GroupStore
from forge_rl.actors.replay_buffer_config import ReplayBufferConfig
from forge_rl.config import ConfigError, load_config
from forge_rl.loop.sampling import (
    KEPT_SET,
    NEUTRAL,
    REPRODUCED,
    SET_BY_GENERATOR,
    behaviour_temperature,
    check_sampling_values,
    truncation,
    untrainable,
    plainly_valid,
)
from forge_rl.recipes.grpo_checks import check_config, derive_settings
from forge_rl.recipes.grpo_config import GRPOConfig
from forge_rl.types import Completion, Episode, Group
from tests.conftest import REPO

# a value of each option that changes the distribution: written here by hand, not read from NEUTRAL
NOT_REPRODUCED = {
    "repetition_penalty": 1.1,
    "presence_penalty": 0.5,
    "frequency_penalty": 0.5,
    "logit_bias": {5: 2.0},
    "allowed_token_ids": [5, 6],
    "bad_words": ["7"],
    "min_tokens": 3,
    "structured_outputs": {"regex": "[0-9]+"},
    "watermarking": {"key": 1},
    "extra_args": {"logits_processors": ["x"]},
    "thinking_token_budget": 64,
    "repetition_detection": {"window": 4},
}


def test_every_vllm_sampling_field_is_classified_once():
    """A field a vLLM release adds fails here until someone decides whether the trainer reproduces it."""
    from vllm import SamplingParams

    fields = {f for f in SamplingParams.__struct_fields__ if not f.startswith("_")}
    classes = [REPRODUCED, SET_BY_GENERATOR, set(KEPT_SET), set(NEUTRAL)]
    assert set().union(*classes) == fields, "unclassified: " + str(sorted(fields - set().union(*classes)))
    assert sum(len(c) for c in classes) == len(fields)  # disjoint
    assert set(NOT_REPRODUCED) == set(NEUTRAL)  # every distribution-changing option has a refusal test below


@pytest.mark.parametrize("option", sorted(NOT_REPRODUCED))
def test_options_the_trainer_cannot_reproduce_are_refused_by_name(option):
    with pytest.raises(ValueError, match=rf"generator\.sampling\.{option}="):
        behaviour_temperature({"temperature": 0.7, option: NOT_REPRODUCED[option]})


@pytest.mark.parametrize("option", sorted(NEUTRAL))
def test_neutral_values_are_accepted(option):
    assert behaviour_temperature({"temperature": 0.7, option: NEUTRAL[option][0]}) == 0.7


def test_reproduced_options_pass_and_generator_owned_or_unknown_ones_are_refused():
    ok = {"temperature": 0.7, "max_tokens": 12, "stop": ["\n"], "stop_token_ids": [2], "seed": 3, "ignore_eos": True}
    assert behaviour_temperature(ok) == 0.7
    with pytest.raises(ValueError, match=r"generator\.sampling\.logprobs is set by the generator"):
        behaviour_temperature({"logprobs": 5})
    with pytest.raises(ValueError, match=r"generator\.sampling\.top_pp is not a vLLM SamplingParams option"):
        behaviour_temperature({"top_pp": 0.9})


@pytest.mark.parametrize("sampling", [{"top_p": 0.8}, {"top_k": 20}, {"min_p": 0.05}, {"top_p": 0.95, "top_k": 20}])
def test_truncation_is_reproduced_over_the_kept_set_and_a_top_k_over_the_cap_is_refused(sampling):
    assert behaviour_temperature({"temperature": 0.7, **sampling}, max_kept_tokens=64) == 0.7
    assert truncation({"temperature": 0.7, "max_tokens": 4, **sampling}) == sampling
    assert truncation({"top_p": 1.0, "top_k": -1, "min_p": 0.0}) == {}  # their neutral values truncate nothing
    with pytest.raises(
        ValueError,
        match=r"^generator\.sampling\.top_k=65 keeps more tokens than .*"
        r"generator\.max_kept_tokens=64",
    ):
        behaviour_temperature({"temperature": 0.7, **sampling, "top_k": 65}, max_kept_tokens=64)


def test_greedy_sampling_cannot_be_trained_on():
    with pytest.raises(ValueError, match="temperature > 0"):
        behaviour_temperature({"temperature": 0.0})


def grpo(*overrides: str) -> GRPOConfig:
    return load_config(GRPOConfig, REPO / "configs/grpo/tiny.yaml", list(overrides))


def test_trainer_reads_the_sampling_temperature():
    cfg = grpo("generator.sampling.temperature=0.7")  # the override the docs show
    check_config(cfg)
    derive_settings(cfg)
    assert cfg.trainer.temperature == 0.7


@pytest.mark.parametrize("truncated", [["top_p=0.8"], ["top_k=20"], ["min_p=0.05"], ["top_p=0.95", "top_k=20"]])
def test_truncated_sampling_in_the_grpo_config_passes_its_check(truncated):
    cfg = grpo("generator.sampling.temperature=0.7", *(f"generator.sampling.{t}" for t in truncated))
    check_config(cfg)
    derive_settings(cfg)
    assert cfg.trainer.temperature == 0.7 and cfg.generator.max_kept_tokens == 64


def test_a_second_temperature_that_disagrees_is_an_error_naming_both_keys():
    cfg = grpo("generator.sampling.temperature=0.7", "trainer.temperature=1.0")
    with pytest.raises(ConfigError, match=r"trainer\.temperature=1\.0.*generator\.sampling\.temperature=0\.7"):
        check_config(cfg)


def test_raw_logprobs_mode_is_refused():
    cfg = grpo("generator.engine_args.logprobs_mode=raw_logprobs")
    with pytest.raises(ConfigError, match="logprobs_mode"):
        check_config(cfg)


@pytest.mark.parametrize("option", ["repetition_penalty", "structured_outputs", "extra_args"])
def test_an_option_in_the_grpo_config_fails_before_any_actor_starts(option):
    cfg = grpo()
    cfg.generator.sampling[option] = NOT_REPRODUCED[option]
    with pytest.raises(ValueError, match=rf"generator\.sampling\.{option}="):
        check_config(cfg)


def group_sampled_with(sampling: dict | None, **kept) -> Group:
    def episode(advantage: float) -> Episode:
        c = Completion(
            torch.tensor([1, 2]),
            torch.tensor([3, 4]),
            torch.tensor([-1.0, -1.0]),
            torch.tensor([0, 0]),
            "stop",
            sampling=sampling,
            **kept,
        )
        return Episode(c, advantage=advantage)

    return Group("p0", [episode(0.5), episode(-0.5)])


def test_the_buffer_refuses_episodes_drawn_with_what_the_trainer_does_not_reproduce():
    store = GroupStore(ReplayBufferConfig(), temperature=1.0)
    assert store.add(group_sampled_with({"temperature": 1.0, "max_tokens": 8, "stop": ["\n"]}))
    assert store.add(group_sampled_with(None))  # made by hand, not by a generator: nothing to check
    kept = dict(
        kept_ids=torch.tensor([3, 9, 4], dtype=torch.int32), kept_offsets=torch.tensor([0, 2, 3], dtype=torch.int32)
    )
    assert store.add(group_sampled_with({"temperature": 1.0, "top_p": 0.8}, **kept))  # its kept sets recorded
    for sampling, named, recorded in [
        ({"temperature": 1.0, "top_p": 0.8}, "it was drawn with top_p=0.8 and carries no sampling mask", {}),
        (
            {"temperature": 1.0, "top_k": 20},
            "1 of its tokens were drawn \\(top_k=20\\) from more tokens than the generator records",
            dict(kept_over_cap=1),
        ),
        ({"temperature": 0.5}, "temperature=0.5 differs from the trainer's 1.0", {}),
        ({"temperature": 1.0, "extra_args": {"logits_processors": ["x"]}}, "extra_args=", {}),
    ]:
        with pytest.raises(ValueError, match=rf"group 'p0' episode 0 cannot be trained on: {named}"):
            store.add(group_sampled_with(sampling, **recorded))
    assert store.added == 6 and store.present == 6  # refused groups left nothing behind


def test_untrainable_without_a_trainer_temperature_checks_only_the_options():
    assert untrainable({"temperature": 0.5}, None) is None
    assert "min_p" in untrainable({"temperature": 0.5, "min_p": 0.1}, None)
    assert untrainable({"temperature": 0.5, "min_p": 0.1}, None, kept_recorded=True) is None
    assert "repetition_penalty" in untrainable({"temperature": 0.5, "repetition_penalty": 1.1}, None, True)


@pytest.mark.parametrize(
    "sampling, line",
    [
        ({"temperature": 1.0, "top_p": 1.5}, "generator.sampling.top_p=1.5: top_p must be in (0, 1]"),
        ({"max_tokens": 0}, "generator.sampling.max_tokens=0: max_tokens must be at least 1"),
        ({"top_k": "x"}, "generator.sampling.top_k='x': not a value of the type vLLM's SamplingParams takes"),
        ({"min_p": 2}, "generator.sampling.min_p=2: min_p must be in [0, 1]"),
    ],
)
def test_vllm_refuses_a_sampling_value_naming_the_config_key_on_one_line(sampling, line):
    with pytest.raises(ConfigError) as e:
        check_sampling_values(sampling)
    assert str(e.value).startswith(line) and "\n" not in str(e.value), str(e.value)


def test_sampling_vllm_takes_passes():
    check_sampling_values({"temperature": 0.7, "top_p": 0.95, "top_k": 20, "max_tokens": 8, "stop": ["\n"]})


@pytest.mark.parametrize(
    "sampling, valid",
    [
        ({"temperature": 1.0, "max_tokens": 8}, True),
        ({}, True),
        ({"temperature": 0.7}, True),
        ({"max_tokens": 0}, False),
        ({"max_tokens": True}, False),
        ({"temperature": float("inf")}, False),
        ({"temperature": 0}, False),
        ({"temperature": 1.0, "top_p": 0.9}, False),
    ],
)
def test_only_plainly_valid_sampling_skips_vllm(sampling, valid):
    """The usual config (a temperature and max_tokens) is checked without importing vLLM; anything else goes to it."""
    assert plainly_valid(sampling) is valid
