"""Learned rewards as actors (forge_rl/actors/reward_model.py): a classifier scored in batches across groups with
transformers' own values, mixed with function rewards by weight; its timeout and a judge's unparsable verdict
counted as failures; a short GRPO run scored by a reward model."""

import asyncio
import json
import math
from pathlib import Path

import pytest
import torch

from forge_rl.actors.reward import RewardActor, RewardSpec, RewardTimeout, RewardUnparsable
from forge_rl.actors.reward_model import RewardModel, judge_score
from forge_rl.config import ConfigError, load_config
from forge_rl.models import resolve_model_path
from forge_rl.runtime import stop_actor
from tests.conftest import provisioned_loop

REPO = Path(__file__).resolve().parents[1]
QUESTIONS = ["12+34=", "5+5=", "70+29="]
ANSWERS = [["46", "45", "x"], ["10", "1 0", "100"], ["99", "98", "9"]]


@pytest.fixture
def loop():
    """conftest's loop, per test here: its provisioner is gone before the GRPO runs below start their own."""
    yield from provisioned_loop()


@pytest.fixture(scope="module")
def classifier(tmp_path_factory) -> Path:
    return make_classifier(tmp_path_factory.mktemp("rm") / "tiny_rm")


def make_classifier(out: Path) -> Path:
    """A one-label HF sequence classifier with tiny-warm's body and a random score head: its scores differ
    between completions, so the checks below mean something."""
    from transformers import Qwen3ForSequenceClassification

    torch.manual_seed(0)
    model = Qwen3ForSequenceClassification.from_pretrained(resolve_model_path("tiny-warm"), num_labels=1,
                                                           pad_token_id=0)
    model.score.weight.data.normal_(0, 1.0)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((Path(resolve_model_path("tiny-warm")) / name).read_bytes())
    return out


def transformers_scores(path: Path, prompts: list[str], completions: list[str]) -> list[float]:
    """What the reward should be, one sequence at a time (no padding) through transformers."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    out = []
    for p, c in zip(prompts, completions):
        text = tok.apply_chat_template([{"role": "user", "content": p}, {"role": "assistant", "content": c}],
                                       tokenize=False)
        with torch.no_grad():
            out.append(float(model(**tok(text, return_tensors="pt", add_special_tokens=False)).logits[0, 0]))  # one label: the logit
    return out


def test_classifier_batches_concurrent_groups_and_mixes_with_function_rewards(loop, classifier):
    rm = loop.run_until_complete(RewardModel.as_actor(str(classifier), 64, 50.0))
    spec = RewardSpec(model=str(classifier), weight=2.0)
    reward = loop.run_until_complete(RewardActor.as_actor(
        [spec, RewardSpec("format", 0.5)], 30.0, models={spec.name: rm}))

    async def groups():  # three groups scored at once, as concurrent rollouts do
        return await asyncio.gather(*(reward.score.call_one([q] * 3, a, ["stop"] * 3) for q, a in zip(QUESTIONS, ANSWERS)))

    results = loop.run_until_complete(groups())
    stats = loop.run_until_complete(rm.stats.call_one())
    assert stats["sequences"] == 9 and stats["forwards"] < 3  # batched across groups, not a forward per group
    for (totals, parts), q, answers in zip(results, QUESTIONS, ANSWERS):
        expected = transformers_scores(classifier, [q] * 3, answers)
        assert parts[spec.name] == pytest.approx(expected, abs=1e-5)  # padded in a batch, same values
        assert spec.name == "classifier:tiny_rm" and set(parts) == {spec.name, "format"}
        assert totals == pytest.approx([2.0 * m + 0.5 * f for m, f in zip(parts[spec.name], parts["format"])])
    assert len({round(v, 4) for _, parts in results for v in parts[spec.name]}) > 3  # it tells completions apart

    # max_concurrency=1: the same three groups go to the model one at a time, a forward each
    one = RewardSpec(model=str(classifier), max_concurrency=1)
    single_rm = loop.run_until_complete(RewardModel.options(mesh_name="single").as_actor(str(classifier), 64, 50.0))
    single = loop.run_until_complete(RewardActor.options(mesh_name="single_reward").as_actor(
        [one], 30.0, models={one.name: single_rm}))

    async def one_at_a_time():
        return await asyncio.gather(*(single.score.call_one([q] * 3, a, ["stop"] * 3) for q, a in zip(QUESTIONS, ANSWERS)))

    loop.run_until_complete(one_at_a_time())
    assert loop.run_until_complete(single_rm.stats.call_one())["forwards"] == 3

    # slower than reward_timeout_s (a forward that waits 2 s for company): the group fails, named and counted
    slow_rm = loop.run_until_complete(RewardModel.options(mesh_name="slow").as_actor(str(classifier), 64, 2000.0))
    slow = loop.run_until_complete(RewardActor.options(mesh_name="slow_reward").as_actor(
        [spec], 0.3, models={spec.name: slow_rm}))
    with pytest.raises(Exception) as failed:
        loop.run_until_complete(slow.score.call_one([QUESTIONS[0]], ["46"], ["stop"]))
    error = getattr(failed.value, "exception", failed.value)
    assert isinstance(error, RewardTimeout) and error.reason == "reward_timeout" and spec.name in str(error)
    for actor in (rm, reward, single_rm, single, slow_rm, slow):
        loop.run_until_complete(stop_actor(actor))


def test_judge_parsing_and_reward_spec_errors():
    assert judge_score("I'd say 7 out of 10", r"(-?\d+(?:\.\d+)?)", 0.1) == pytest.approx(0.7)
    assert judge_score("no verdict", r"(\d+)", 0.1) is None
    assert judge_score("score: nan", r"score: (\w+)", 1.0) is None
    assert judge_score("12", "tests.test_reward_model:halve", 1.0) == 6.0
    assert RewardUnparsable("x").reason == "reward_unparsable"
    with pytest.raises(ValueError, match="a name .* or a model"):
        RewardSpec()
    with pytest.raises(ValueError, match="kind='regression'"):
        RewardSpec(model="tiny", kind="regression")


def halve(text: str) -> float:
    return float(text) / 2


def test_a_missing_reward_model_or_a_bad_setting_is_refused_at_start_naming_the_key(tmp_path):
    from forge_rl.recipes.grpo_config import GRPOConfig, check_config

    cfg = load_config(GRPOConfig, REPO / "configs/grpo/tiny.yaml",
                      [f"output_dir={tmp_path}", "rewards=[{name: exact_match}, {model: /nonexistent/rm}]"])
    with pytest.raises(ConfigError, match=r"rewards\[1\].model: model '/nonexistent/rm'"):
        check_config(cfg)
    bad = "{model: tiny-warm, kind: judge, template: 'Rate {answer}', parser: '(\\\\d+', max_concurrency: 0}"
    cfg = load_config(GRPOConfig, REPO / "configs/grpo/tiny.yaml",
                      [f"output_dir={tmp_path}", f"rewards=[{{name: exact_match}}, {bad}]"])
    with pytest.raises(ConfigError) as refused:
        check_config(cfg)
    for key in ("max_concurrency=0", "template: only {prompt}", "template: it must show", "parser="):
        assert f"rewards[1].{key}" in str(refused.value)


def test_tiny_rm_tells_right_sums_from_wrong_ones(loop):
    """The shipped reward model (forge_rl/models/tiny_rm) through its actor: on held-out questions it never saw, the
    right sum scores above the wrong ones of its group, the near misses a policy makes included (measured: 94 of
    100 pairs; its weak spot is the tens digit, e.g. 49+2= 41)."""
    from forge_rl.data.arithmetic import held_out_problems

    rm = loop.run_until_complete(RewardModel.options(mesh_name="tiny_rm").as_actor("tiny-rm"))
    problems = held_out_problems(20)
    groups = [[p.answer, str(int(p.answer) + 1), str(int(p.answer) - 10), p.answer[::-1] + "1", "", p.answer + "0"]
              for p in problems]

    async def score():
        return await asyncio.gather(*(rm.score.call_one([p.question] * len(g), g) for p, g in zip(problems, groups)))

    scored = loop.run_until_complete(score())
    wins = sum(values[0] > wrong for values in scored for wrong in values[1:])
    assert wins >= 85, f"the right sum scored above a wrong one in {wins} of 100 pairs"
    assert sum(v[0] for v in scored) / 20 > 0.8 > 0.2 > sum(sum(v[1:]) for v in scored) / 100  # p(right), not a rank
    loop.run_until_complete(stop_actor(rm))


def test_grpo_scored_by_the_tiny_rm_and_a_judge(tmp_path):
    """A short GRPO run whose rewards are tiny-rm (weight 1) and exact match at weight 0 (for the held-out evaluation
    only: training never sees the answer column); then one whose judge's verdicts the parser never reads (every
    group it scores fails, counted as reward_unparsable)."""
    from forge_rl.recipes.grpo import main
    from forge_rl.recipes.grpo_config import GRPOConfig

    cfg = load_config(GRPOConfig, REPO / "configs/grpo/tiny_rm.yaml", [
        "steps=2", "batch_groups=4", "group_size=4", "rollout_tasks=4", "eval_size=16", "eval_every=0",
        "buffer.capacity=8", f"output_dir={tmp_path}", "export_dir=null"])
    summary = asyncio.run(main(cfg))
    assert summary["trainer_version"] == 2
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    scored = [r for r in rows if "reward/classifier:tiny-rm" in r]
    assert scored and all(0 < r["reward/classifier:tiny-rm"] < 1 for r in scored)
    for r in scored:  # the total is the weighted sum of the parts, exact match's weight 0 included
        assert math.isclose(r["reward/mean"], r["reward/classifier:tiny-rm"] + 0.1 * r["reward/format"], abs_tol=1e-6)

    judge = (f"rewards=[{{model: tiny-warm, kind: judge, parser: 'VERDICT=(\\d+)', weight: 1.0}}, "
             f"{{name: exact_match, weight: 0.0}}]")
    cfg = load_config(GRPOConfig, REPO / "configs/grpo/tiny.yaml", [
        "steps=1", "batch_groups=2", "group_size=2", "rollout_tasks=2", "eval_size=8", "eval_every=0",
        "buffer.capacity=4", f"output_dir={tmp_path / 'judge'}", judge, "task.eval_reward=exact_match",
        "export_dir=null", "no_batch_timeout_s=20"])
    with pytest.raises(Exception, match="no batch") as stopped:
        asyncio.run(main(cfg))
    assert "reward_unparsable" in str(stopped.value)  # every group failed, and the run says why it has no batch
