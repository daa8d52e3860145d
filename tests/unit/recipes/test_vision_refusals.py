"""What a run with a vision-language model refuses in one line before any actor starts (docs/vision.md): the
trainer settings its vision path does not take yet, trainer.freeze naming no part of the model, and the roles a
vision-language model cannot fill (a critic, a teacher). Through the apps' own command line, in this process
(tests/support/app_checks.py)."""

import pytest

from tests.support.app_checks import check_in_process

VLM_GRPO = ["--config", "configs/grpo/tiny_vlm.yaml"]


@pytest.mark.parametrize(
    "app, argv, says",
    [
        ("grpo", [*VLM_GRPO, "trainer.lora.rank=4"], "trainer.lora.rank: not available for a vision-language model"),
        ("grpo", [*VLM_GRPO, "trainer.parallel.compile=true"], "trainer.parallel.compile: not available"),
        ("ppo", ["--config", "configs/ppo/tiny.yaml", "model=tiny-vlm"], "not the critic yet"),
        ("distill", ["--config", "configs/distill/tiny.yaml", "teacher=tiny-vlm"], "not the teacher yet"),
        ("grpo", [*VLM_GRPO, "trainer.freeze=[vison]"], "trainer.freeze: 'vison' names no parameter of the model"),
        ("grpo", ["--config", "configs/grpo/tiny.yaml", "trainer.freeze=[vision]"], "'vision' names no parameter"),
    ],
    ids=["lora", "compile", "critic", "teacher", "freeze-typo", "freeze-text-model"],
)
def test_what_a_vision_language_run_cannot_do_is_refused_in_one_line(app, argv, says, monkeypatch, tmp_path):
    monkeypatch.delenv("FORGE_RL_DEBUG", raising=False)
    monkeypatch.setattr("forge_rl.recipes.command_line.handle_stop_signals", lambda: None)
    checked = check_in_process(app, [*argv, f"output_dir={tmp_path}"])
    assert checked.status == 2, checked.stderr
    (line,) = checked.stderr.strip().splitlines()
    assert line.startswith("forge_rl: ") and says in line, line
    assert "starting actors" not in checked.stdout


def test_a_vision_language_model_whose_language_model_the_trainer_does_not_build_is_refused(tmp_path):
    from forge_rl.errors import ConfigError
    from forge_rl.models import check_role

    config = {"model_type": "idefics3", "vision_config": {}, "text_config": {"model_type": "mistral"}}
    with pytest.raises(ConfigError, match="its language model is 'mistral'"):
        check_role(config, "model='x'", "policy")
    config = {"model_type": "qwen2_5_vl", "vision_config": {}, "architectures": ["Qwen2_5_VLForConditionalGeneration"]}
    with pytest.raises(ConfigError, match="vision-language models of type idefics3, not 'qwen2_5_vl'"):
        check_role(config, "model='x'", "policy")
    check_role({"model_type": "idefics3", "vision_config": {}, "text_config": {"model_type": "llama"}}, "m", "policy")
