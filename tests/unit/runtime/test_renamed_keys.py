"""A key the config renamed is refused in one line that names the new one, in a file as on the command line."""

import pytest

from forge_rl.config import ConfigError, load_config
from forge_rl.recipes.grpo_config import GRPOConfig
from forge_rl.recipes.ppo_config import PPOConfig
from forge_rl.recipes.sft_config import SFTConfig


@pytest.mark.parametrize("schema", [GRPOConfig, PPOConfig])
def test_the_trainers_step_timeout_is_trainer_step_s(schema, tmp_path):
    with pytest.raises(ConfigError, match=r"'timeouts.train_step_s' .* is now 'timeouts.trainer_step_s'$"):
        load_config(schema, None, ["timeouts.train_step_s=20"])
    path = tmp_path / "run.yaml"
    path.write_text("timeouts:\n  train_step_s: 20\n")
    with pytest.raises(ConfigError, match=rf"'timeouts.train_step_s' in file {path} is now 'timeouts.trainer_step_s'$"):
        load_config(schema, path)
    assert load_config(schema, None, ["timeouts.trainer_step_s=20"]).timeouts.trainer_step_s == 20


@pytest.mark.parametrize(
    "schema, old, new, override",
    [
        (GRPOConfig, "trainer.grpo.kl_coef=0.1", "trainer.loss", "trainer.loss.kl_coef=0.1"),
        (PPOConfig, "ppo.gamma=0.9", "gae", "gae.gamma=0.9"),
    ],
)
def test_the_loss_section_is_trainer_loss_and_gae_is_gae(schema, old, new, override):
    with pytest.raises(ConfigError, match=rf"is now '{new}'$"):
        load_config(schema, None, [old])
    assert load_config(schema, None, [override])


def test_the_old_objective_string_names_trainer_objective(tmp_path):
    path = tmp_path / "sft.yaml"
    path.write_text("trainer:\n  loss: sft\n")
    with pytest.raises(ConfigError, match=r"'trainer.loss' .* expects a mapping, got 'sft' .*now trainer.objective\)$"):
        load_config(SFTConfig, path)
    assert load_config(SFTConfig, None, ["trainer.objective=sft"]).trainer.objective == "sft"
