"""Learned rewards as actors (forge_rl/actors/reward_model.py): a classifier scored in batches across groups with
transformers' own values, mixed with function rewards by weight; its timeout and a judge's unparsable verdict
counted as failures; a short GRPO run scored by a reward model."""

import asyncio
import json
import math
import time
from pathlib import Path

import pytest
import torch

from forge_rl.actors.reward import RewardActor, RewardTimeout, RewardUnparsable, judge_engine_args, reward_model_errors
from forge_rl.rewards.reward_config import RewardConfig
from forge_rl.actors.reward_model import RewardModel, judge_score
from forge_rl.config import ConfigError, load_config
from forge_rl.models import resolve_model_path
from forge_rl.runtime import stop_actor
from tests.conftest import provisioned_loop

REPO = Path(__file__).resolve().parents[2]  # tests/integration/ -> the repository
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
    model = Qwen3ForSequenceClassification.from_pretrained(
        resolve_model_path("tiny-warm"), num_labels=1, pad_token_id=0
    )
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
        text = tok.apply_chat_template(
            [{"role": "user", "content": p}, {"role": "assistant", "content": c}], tokenize=False
        )
        with torch.no_grad():
            out.append(
                float(model(**tok(text, return_tensors="pt", add_special_tokens=False)).logits[0, 0])
            )  # one label: the logit
    return out


def test_classifier_batches_concurrent_groups_and_mixes_with_function_rewards(loop, classifier):
    rm = loop.run_until_complete(RewardModel.as_actor(str(classifier), 64, 50.0))
    spec = RewardConfig(model=str(classifier), weight=2.0)
    reward = loop.run_until_complete(
        RewardActor.as_actor([spec, RewardConfig("format", 0.5)], 30.0, models={spec.name: rm})
    )

    async def groups():  # three groups scored at once, as concurrent rollouts do
        return await asyncio.gather(
            *(reward.score.call_one([q] * 3, a, ["stop"] * 3) for q, a in zip(QUESTIONS, ANSWERS))
        )

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
    one = RewardConfig(model=str(classifier), max_concurrency=1)
    single_rm = loop.run_until_complete(RewardModel.options(mesh_name="single").as_actor(str(classifier), 64, 50.0))
    single = loop.run_until_complete(
        RewardActor.options(mesh_name="single_reward").as_actor([one], 30.0, models={one.name: single_rm})
    )

    async def one_at_a_time():
        return await asyncio.gather(
            *(single.score.call_one([q] * 3, a, ["stop"] * 3) for q, a in zip(QUESTIONS, ANSWERS))
        )

    loop.run_until_complete(one_at_a_time())
    assert loop.run_until_complete(single_rm.stats.call_one())["forwards"] == 3

    # slower than reward_timeout_s (a forward that waits 2 s for company): the group fails, named and counted
    slow_rm = loop.run_until_complete(RewardModel.options(mesh_name="slow").as_actor(str(classifier), 64, 2000.0))
    slow = loop.run_until_complete(
        RewardActor.options(mesh_name="slow_reward").as_actor([spec], 0.3, models={spec.name: slow_rm})
    )
    with pytest.raises(Exception) as failed:
        loop.run_until_complete(slow.score.call_one([QUESTIONS[0]], ["46"], ["stop"]))
    error = getattr(failed.value, "exception", failed.value)
    assert isinstance(error, RewardTimeout) and error.reason == "reward_timeout" and spec.name in str(error)
    loop.run_until_complete(asyncio.sleep(2.5))  # the window ends: the request, abandoned, is dropped there
    assert loop.run_until_complete(slow_rm.stats.call_one())["expired"] == 1
    assert loop.run_until_complete(slow_rm.stats.call_one())["forwards"] == 0  # no forward for nobody
    for actor in (rm, reward, single_rm, single, slow_rm, slow):
        loop.run_until_complete(stop_actor(actor))


def test_max_batch_holds_and_a_failed_batch_is_retried_request_by_request(loop, classifier):
    """A group larger than max_batch runs in forwards of at most max_batch, same values; a request whose forward
    fails (a fault injected into a real RewardModel) fails alone, the groups batched with it are scored."""
    from tests.support.poisoned_reward_model import PoisonedRewardModel

    rm = loop.run_until_complete(PoisonedRewardModel.options(mesh_name="poisoned").as_actor(str(classifier), 4, 300.0))
    nine = [str(i) for i in range(9)]
    values = loop.run_until_complete(rm.score.call_one(["12+34="] * 9, nine))
    assert values == pytest.approx(transformers_scores(classifier, ["12+34="] * 9, nine), abs=1e-5)
    assert loop.run_until_complete(rm.stats.call_one())["largest_forward"] == 4

    async def three_groups():  # arrive within one window: batched together
        return await asyncio.gather(
            *(
                rm.score.call_one([q] * 2, a)
                for q, a in [("1+1=", ["2", "3"]), ("2+2=", ["POISON", "4"]), ("3+3=", ["6", "7"])]
            ),
            return_exceptions=True,
        )

    good, poisoned, also_good = loop.run_until_complete(three_groups())
    assert "poisoned input" in str(poisoned)
    assert good == pytest.approx(transformers_scores(classifier, ["1+1="] * 2, ["2", "3"]), abs=1e-5)
    assert also_good == pytest.approx(transformers_scores(classifier, ["3+3="] * 2, ["6", "7"]), abs=1e-5)
    loop.run_until_complete(stop_actor(rm))


def test_an_input_longer_than_the_context_keeps_the_end_of_its_completion():
    from transformers import AutoTokenizer

    from forge_rl.actors.reward_model import fit_completion

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("tiny-rm"))

    def render(c: str) -> str:
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": "12+34="}, {"role": "assistant", "content": c}], tokenize=False
        )

    long = " ".join(str(i % 10) for i in range(2000)) + " so the answer is 46"
    text = fit_completion(render, long, tokenizer, 512)
    assert len(tokenizer(text, add_special_tokens=False).input_ids) <= 512
    assert "so the answer is 46" in text and "12+34=" in text  # the prompt and the completion's end are kept
    assert fit_completion(render, "46", tokenizer, 512) == render("46")  # what fits is left alone
    with pytest.raises(ValueError, match="even without the completion"):
        fit_completion(render, long, tokenizer, 5)


def test_judge_parsing_and_reward_spec_errors():
    assert judge_score("I'd say 7 out of 10", r"(-?\d+(?:\.\d+)?)", 0.1) == pytest.approx(0.7)
    assert judge_score("no verdict", r"(\d+)", 0.1) is None
    assert judge_score("score: nan", r"score: (\w+)", 1.0) is None
    assert judge_score("12", "tests.integration.test_reward_model:halve", 1.0) == 6.0
    assert judge_engine_args(RewardConfig(model="tiny", kind="judge")) == {"tensor_parallel_size": 1}
    assert judge_engine_args(RewardConfig(model="tiny", kind="judge", engine_args={"max_model_len": 256})) == {
        "tensor_parallel_size": 1,
        "max_model_len": 256,
    }
    assert RewardUnparsable("x").reason == "reward_unparsable"
    with pytest.raises(ValueError, match="a name .* or a model"):
        RewardConfig()
    # an unknown kind is the settings check's (it knows the entry's index: rewards[i].kind), not the dataclass's
    assert reward_model_errors(RewardConfig(model="tiny", kind="regression")) == [
        "kind='regression': the reward model 'tiny' has no such kind; choose one of ('classifier', 'judge')"
    ]


def halve(text: str) -> float:
    return float(text) / 2


def test_a_missing_reward_model_or_a_bad_setting_is_refused_at_start_naming_the_key(tmp_path):
    from forge_rl.recipes.grpo_checks import check_config
    from forge_rl.recipes.grpo_config import GRPOConfig

    cfg = load_config(
        GRPOConfig,
        REPO / "configs/grpo/tiny.yaml",
        [f"output_dir={tmp_path}", "rewards=[{name: exact_match}, {model: /nonexistent/rm}]"],
    )
    with pytest.raises(ConfigError, match=r"rewards\[1\].model='/nonexistent/rm': no such directory"):
        check_config(cfg)
    bad = "{model: tiny-warm, kind: judge, template: 'Rate {answer}', parser: '(\\\\d+', max_concurrency: 0}"
    cfg = load_config(
        GRPOConfig,
        REPO / "configs/grpo/tiny.yaml",
        [f"output_dir={tmp_path}", f"rewards=[{{name: exact_match}}, {bad}]"],
    )
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
    groups = [
        [p.answer, str(int(p.answer) + 1), str(int(p.answer) - 10), p.answer[::-1] + "1", "", p.answer + "0"]
        for p in problems
    ]

    async def score():
        return await asyncio.gather(*(rm.score.call_one([p.question] * len(g), g) for p, g in zip(problems, groups)))

    scored = loop.run_until_complete(score())
    wins = sum(values[0] > wrong for values in scored for wrong in values[1:])
    assert wins >= 85, f"the right sum scored above a wrong one in {wins} of 100 pairs"
    assert sum(v[0] for v in scored) / 20 > 0.8 > 0.2 > sum(sum(v[1:]) for v in scored) / 100  # p(right), not a rank
    loop.run_until_complete(stop_actor(rm))


def test_grpo_scored_by_the_tiny_rm_and_a_judge(tmp_path):
    """A short GRPO run whose rewards are tiny-rm (weight 1), a judge (tiny-warm on its own engine args, its verdict
    parsed and scaled) and exact match at weight 0 (for the held-out evaluation only: training never sees the
    answer column). One run holds both learned rewards: each is its own actor on its own procs either way."""
    from forge_rl.recipes.grpo import main
    from forge_rl.recipes.grpo_config import GRPOConfig

    judge = (
        "{model: tiny-warm, kind: judge, template: '{prompt}{completion}', parser: '(\\d+)', scale: 0.001, "
        "weight: 1.0, engine_args: {max_model_len: 96}}"
    )
    rewards = (
        f"rewards=[{{model: tiny-rm, kind: classifier, weight: 1.0}}, {{name: format, weight: 0.1}}, {judge}, "
        "{name: exact_match, weight: 0.0}]"
    )
    cfg = load_config(
        GRPOConfig,
        REPO / "configs/grpo/tiny_rm.yaml",
        [
            "steps=2",
            "batch_groups=4",
            "group_size=4",
            "rollout_tasks=4",
            "eval_size=16",
            "eval_every=0",
            "buffer.capacity=8",
            f"output_dir={tmp_path}",
            "export_dir=null",
            rewards,
        ],
    )
    summary = asyncio.run(main(cfg))
    assert summary["trainer_version"] == 2
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    scored = [r for r in rows if "reward/classifier:tiny-rm" in r]
    assert scored and all(0 < r["reward/classifier:tiny-rm"] < 1 for r in scored)
    # the judge (tiny-warm, which answers sums) says a number: parsed, scaled
    judged = [r["reward/judge:tiny-warm"] for r in scored]
    assert all(0 <= v and math.isfinite(v) for v in judged), judged
    for r in scored:  # the total is the weighted sum of the parts, exact match's weight 0 included
        total = r["reward/classifier:tiny-rm"] + 0.1 * r["reward/format"] + r["reward/judge:tiny-warm"]
        assert math.isclose(r["reward/mean"], total, abs_tol=1e-6), r


def test_a_judges_unparsable_or_stuck_parser_fails_its_groups_named(loop):
    """One judge engine, two specs: a parser that finds nothing fails the group as reward_unparsable, a parser
    that never returns ends at the timeout in a reward worker (the actor goes on scoring), a good one scores."""
    from forge_rl.actors.generator import Generator

    judge = loop.run_until_complete(
        Generator.options(mesh_name="judge").as_actor(
            resolve_model_path("tiny-warm"),
            engine_args=judge_engine_args(RewardConfig(model="tiny-warm", kind="judge")),
            sampling=dict(temperature=0.0, max_tokens=4),
            policy_weights=False,
        )
    )
    judged = dict(model="tiny-warm", kind="judge", template="{prompt}{completion}")
    specs = [
        RewardConfig("ok", parser=r"(\d+)", max_tokens=4, **judged),
        RewardConfig("never", parser=r"VERDICT=(\d+)", **judged),
        RewardConfig("stuck", parser="tests.integration.test_reward_model:stuck_parser", **judged),
    ]
    reward = loop.run_until_complete(
        RewardActor.options(mesh_name="judged").as_actor(specs, 10.0, 2, models={s.name: judge for s in specs})
    )
    loop.run_until_complete(judge.generate.call_one("1+1=", n=1))  # the engine's first step (warm-up) is slow
    start = time.perf_counter()
    parts = loop.run_until_complete(reward.score_each_reward.call_one(["12+34="], ["46"], ["stop"]))
    assert time.perf_counter() - start < 40  # the stuck parser costs reward_timeout_s, no more
    assert not isinstance(parts["ok"], str) and math.isfinite(parts["ok"][0]), parts
    assert parts["never"].startswith("RewardUnparsable: judge 'never': no number in its verdict")
    assert parts["stuck"].startswith("RewardTimeout") and "'stuck'" in parts["stuck"], parts["stuck"]
    # a judge serves its own checkpoint: it has no weight store to load the policy's versions from
    with pytest.raises(Exception, match="serves its own checkpoint"):
        loop.run_until_complete(judge.update_weights.call_one(1))
    # a request past its deadline is aborted in the engine (vLLM aborts a cancelled stream), and the engine goes on
    start = time.perf_counter()
    with pytest.raises(Exception, match="not finished within 0.2 s; aborted"):
        loop.run_until_complete(judge.generate.call_one("1+1=", n=1, max_tokens=400, ignore_eos=True, timeout_s=0.2))
    assert time.perf_counter() - start < 10
    assert loop.run_until_complete(judge.stats.call_one())["tokens_generated_in_flight"] == 0
    assert len(loop.run_until_complete(judge.generate.call_one("1+1=", n=1))) == 1
    for actor in (reward, judge):
        loop.run_until_complete(stop_actor(actor))


def stuck_parser(text: str) -> float:
    while True:
        time.sleep(60)
