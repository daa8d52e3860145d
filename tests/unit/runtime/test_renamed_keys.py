"""A key the config renamed is refused in one line that names the new one, in a file as on the command line."""

import pytest

from forge_rl.config import ConfigError, load_config
from forge_rl.recipes.grpo_config import GRPOConfig
from forge_rl.recipes.ppo_config import PPOConfig


@pytest.mark.parametrize("schema", [GRPOConfig, PPOConfig])
def test_the_trainers_step_timeout_is_trainer_step_s(schema, tmp_path):
    with pytest.raises(ConfigError, match=r"'timeouts.train_step_s' .* is now 'timeouts.trainer_step_s'$"):
        load_config(schema, None, ["timeouts.train_step_s=20"])
    path = tmp_path / "run.yaml"
    path.write_text("timeouts:\n  train_step_s: 20\n")
    with pytest.raises(ConfigError, match=rf"'timeouts.train_step_s' in file {path} is now 'timeouts.trainer_step_s'$"):
        load_config(schema, path)
    assert load_config(schema, None, ["timeouts.trainer_step_s=20"]).timeouts.trainer_step_s == 20
