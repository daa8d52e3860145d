"""On-policy distillation (apps/distill): the tokenizer check, and a short run on the tiny model whose teacher
(tiny-teacher) scores every token the student samples."""

import asyncio
import json
import math
import shutil
from pathlib import Path

import pytest

from forge_rl.recipes.distill import DistillConfig, check_same_tokenizer, main
from forge_rl.config import ConfigError, load_config
from forge_rl.models import resolve_model_path

REPO = Path(__file__).resolve().parents[2]  # tests/integration/ -> the repository
SMALL = [
    "batch_groups=4",
    "group_size=4",
    "rollout_tasks=2",
    "eval_size=32",
    "eval_every=0",
    "buffer.capacity=8",
    "generator.sampling.max_tokens=6",
]


def test_a_teacher_with_another_tokenizer_is_refused_naming_it(tmp_path):
    from transformers import AutoTokenizer

    student = resolve_model_path("tiny-warm")
    check_same_tokenizer(student, resolve_model_path("tiny-teacher"))  # same tokenizer: fine
    other = tmp_path / "other"
    shutil.copytree(student, other)
    tok = AutoTokenizer.from_pretrained(student)
    tok.add_tokens(["<tool>"])
    tok.save_pretrained(other)
    with pytest.raises(ConfigError, match=f"teacher='{other}' has another tokenizer than model="):
        check_same_tokenizer(student, str(other))


def test_distillation_run_scores_every_sampled_token_with_the_teacher(tmp_path):
    """Every group gets the same reward (no reward signal at all) and the run asks for GRPO's filter that drops
    such groups: distillation turns the filter off, so the run keeps and trains them on the teacher's signal. A
    GRPO run with this filter would drop every group and never get a batch (no_batch_timeout_s says so)."""
    cfg = load_config(
        DistillConfig,
        REPO / "configs/distill/tiny.yaml",
        SMALL
        + [
            "steps=4",
            f"output_dir={tmp_path}",
            "buffer.drop_zero_advantage=true",
            "no_batch_timeout_s=60",
            "rewards=[{name: 'tests.support.actors:constant_reward', weight: 1.0}]",
        ],
    )
    summary = asyncio.run(main(cfg))
    assert summary["trainer_version"] == 4 and summary["generator_versions"] == [4]
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    scored = [m for m in lines if "reward/mean" in m and math.isfinite(m["reward/mean"])]
    assert scored and all(m["reward/mean"] == 1.0 and m["reward/std"] == 0.0 for m in scored)  # all equal
    kls = [m["trainer/reverse_kl_teacher"] for m in lines if "trainer/reverse_kl_teacher" in m]
    # the teacher is another model: its logprobs differ from the student's on the student's samples
    assert len(kls) == 4 and all(math.isfinite(k) and k > 1e-3 for k in kls), kls
    # 4 steps of 4 groups whose advantages are all zero, every one kept and trained
    assert summary["drops"].get("zero_advantage", 0) == 0 and summary["buffer"]["trained"] >= 4 * 4 * 4
    assert (tmp_path / "hf" / "model.safetensors").is_file()  # the distilled student, exported
