"""A run asked to train a vision-language model ends in one line before any actor starts: forge_rl samples image
prompts with one (docs/vision.md) but its trainer does not train one yet. Through the apps' own command line, in
this process (tests/support/app_checks.py)."""

import pytest

from tests.support.app_checks import check_in_process


@pytest.mark.parametrize(
    "app, argv",
    [
        ("grpo", ["--config", "configs/grpo/tiny.yaml", "model=tiny-vlm", "task.source=digit_sum"]),
        ("sft", ["--config", "configs/sft/tiny.yaml", "model=tiny-vlm"]),
        ("distill", ["--config", "configs/distill/tiny.yaml", "teacher=tiny-vlm"]),
    ],
)
def test_a_vision_language_model_to_train_is_refused_in_one_line(app, argv, monkeypatch):
    monkeypatch.delenv("FORGE_RL_DEBUG", raising=False)
    monkeypatch.setattr("forge_rl.recipes.command_line.handle_stop_signals", lambda: None)
    checked = check_in_process(app, argv)
    assert checked.status == 2, checked.stderr
    (line,) = checked.stderr.strip().splitlines()
    assert line.startswith("forge_rl: ") and "=" in line
    assert "is a vision-language model (Idefics3ForConditionalGeneration)" in line and "does not train one" in line
    assert "starting actors" not in checked.stdout
