"""Every model path is checked for what its role loads, before any actor starts: one line naming the key, the
path's architecture and what the role needs (forge_rl/models/__init__.py: model_path)."""

import json
import shutil

import pytest

from forge_rl.errors import ConfigError
from forge_rl.models import model_path, resolve_model_path


@pytest.mark.parametrize(
    "model, role",
    [
        ("tiny-warm", "policy"),
        ("tiny-teacher", "teacher"),
        ("tiny-warm", "reference"),
        ("tiny-moe", "policy"),
        ("tiny-rm", "reward model"),
        ("tiny-rm", "critic"),
        ("tiny-warm", "judge"),
        ("tiny-warm", "critic"),
    ],
)
def test_each_embedded_model_fits_the_roles_it_is_made_for(model, role):
    assert model_path(model, "model", role=role) == resolve_model_path(model)


@pytest.mark.parametrize(
    "model, role, key, says",
    [
        (
            "tiny-rm",
            "policy",
            "model",
            "architecture Qwen3ForSequenceClassification, but the policy needs a *ForCausalLM",
        ),
        ("tiny-rm", "teacher", "teacher", "the teacher needs a *ForCausalLM"),
        ("tiny-warm", "reward model", "rewards[0].model", "the reward model needs a *ForSequenceClassification"),
        ("tiny-rm", "judge", "rewards[0].model", "the judge needs a *ForCausalLM"),
    ],
)
def test_a_model_given_for_the_wrong_role_is_one_line_naming_key_and_architecture(model, role, key, says):
    with pytest.raises(ConfigError) as e:
        model_path(model, key, role=role)
    assert str(e.value).startswith(f"{key}={model!r}: ") and says in str(e.value) and "\n" not in str(e.value)


def test_a_model_type_the_trainer_does_not_build_is_refused_naming_it(tmp_path):
    llama = tmp_path / "llama"
    shutil.copytree(resolve_model_path("tiny-warm"), llama)
    config = json.loads((llama / "config.json").read_text())
    (llama / "config.json").write_text(
        json.dumps({**config, "model_type": "llama", "architectures": ["LlamaForCausalLM"]})
    )
    with pytest.raises(ConfigError, match=r"model_type 'llama' is not one forge_rl trains \(qwen3, qwen3_moe\)"):
        model_path(str(llama))
