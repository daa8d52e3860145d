"""GRPO end to end on the warm-started tiny model: async run, then a synchronous resume of it."""

import asyncio
import json
import math

import pytest
import torch

from forge_rl.recipes.grpo import GRPOConfig, main
from forge_rl.config import ConfigError, load_config
from forge_rl.models import resolve_model_path
from forge_rl.observability.metrics import read_jsonl
from tests.conftest import REPO

SMALL = [
    "batch_groups=4",
    "group_size=4",
    "rollout_tasks=2",
    "eval_size=32",
    "eval_every=0",
    "buffer.capacity=8",
    "generator.sampling.max_tokens=6",
]


def test_grpo_async_run_then_synchronous_resume(tmp_path, capsys):
    cfg = load_config(
        GRPOConfig,
        REPO / "configs/grpo/tiny.yaml",
        SMALL
        + [
            "steps=3",
            f"output_dir={tmp_path}",
            "max_policy_age=1",
            "checkpoint_every=1",
            "checkpoint_keep_last=2",
            "trainer.profile_steps=[2]",
        ],
    )
    first = asyncio.run(main(cfg))
    # trainer.profile_steps: step 2's trace in output_dir/profile/, its top operators printed under its line
    assert [p.name for p in (tmp_path / "profile").iterdir()] == ["rank0_step2.json.gz"]
    assert "\nprofile rank 0 step 2, self CPU time " in capsys.readouterr().out
    # a checkpoint every step, the newest two kept (step 3 once: finish() keeps the one the schedule wrote)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-2", "step-3"]
    # weights went trainer -> store -> generator every step, and no batch broke the staleness bound
    assert first["trainer_version"] == 3 and first["generator_version"] == 3
    assert first["max_staleness"] <= 1
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    steps = [r for r in rows if "trainer/loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(math.isfinite(r["trainer/loss"]) for r in steps)
    # reward/* is over the groups scored during that step (absent when none finished, in async mode)
    scored = [r for r in rows if "reward/mean" in r]
    assert scored and all(0.0 <= r["reward/exact_match"] <= 1.0 for r in scored)
    assert any(r["reward/mean"] > 0 for r in scored)  # the warm start solves some problems
    accounting = first["buffer"]
    assert accounting["added"] == accounting["trained"] + sum(accounting["dropped"].values()) + accounting["present"]
    assert (tmp_path / "curves.png").stat().st_size > 10_000
    # the timeline: what each role did when, as a Chrome trace and a PNG, and the summary's busy fractions
    trace = json.loads((tmp_path / "timeline.json").read_text())["traceEvents"]
    lanes = {e["args"]["name"] for e in trace if e["ph"] == "M"}
    assert {"controller", "trainer", "weight swaps", "rollout 0"} <= lanes, lanes
    assert sum(e["name"] == "score + train + publish" for e in trace if e["ph"] == "X") == 3
    # the engines' busy share since the step before, from the second step on: a counter track and a metric
    busy = [e["args"]["generators busy"] for e in trace if e["ph"] == "C"]
    # (the last step's may be 0: nothing is admitted once every remaining step has its groups)
    assert len(busy) == 2 and 0 < busy[0] <= 1 and 0 <= busy[1] <= 1, busy
    assert [r.get("generator/busy") for r in steps] == [None, *busy]
    assert (tmp_path / "timeline.png").stat().st_size > 5_000 and 0 < first["busy_fraction"]["trainer"] < 1
    # the generators' figure is the engines' own count of time with requests in them, not a timeline lane
    assert first["busy_fraction"]["generators"] == round(1 - first["generator_idle_fraction"], 3) > 0
    # the role procs' output went to their log files, not the console (vLLM always says a few words)
    assert (tmp_path / "logs/Trainer.log").is_file() and (tmp_path / "logs/Generator-r0g0.log").stat().st_size > 0
    assert json.loads((tmp_path / "summary.json").read_text())["trainer_version"] == 3

    # resume from the final checkpoint as a strictly synchronous run: same step, same data position
    cfg = load_config(
        GRPOConfig,
        REPO / "configs/grpo/tiny.yaml",
        SMALL + ["steps=5", f"output_dir={tmp_path}", "resume=true", "async_mode=false", "max_policy_age=0"],
    )
    second = asyncio.run(main(cfg))
    assert second["start_step"] == 3 and second["trainer_version"] == 5 and second["generator_version"] == 5
    assert second["max_staleness"] == 0  # synchronous: every token from the weights being trained
    resumed = [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl") if "trainer/loss" in r]
    assert resumed == [1, 2, 3, 4, 5]


@pytest.fixture(scope="module")
def users_task_run(tmp_path_factory):
    """One short run shared by the two tests below (each setting is independent of the other's): a user's task
    (their JSONL with their own column names, a reward of theirs reading an extra column, a held-out file, a prompt
    too long for the engine) and a KL penalty to a moving anchor (reference.follow_every=1, follow_lag=1).
    Returns (the run's folder, the folder its data came from, its summary)."""
    import random

    tmp_path = tmp_path_factory.mktemp("users_task")
    rng = random.Random(0)
    rows = [
        {"q": f"{a}+{b}=", "sum": a + b, "bonus": 0.5}
        for a, b in ((rng.randint(0, 99), rng.randint(0, 99)) for _ in range(9))
    ]
    rows.append({"q": "1+1=" * 200, "sum": 2, "bonus": 0.5})  # far beyond max_model_len 128
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:6]))
    cfg = load_config(
        GRPOConfig,
        REPO / "configs/grpo/tiny.yaml",
        SMALL
        + [
            "steps=4",
            f"output_dir={tmp_path}/run",
            f"task.source={tmp_path}/train.jsonl",
            "task.prompt_column=q",
            "task.answer_column=sum",
            f"task.held_out={tmp_path}/test.jsonl",
            "task.eval_reward=exact_match",
            "buffer.drop_zero_advantage=false",
            "rewards=[{name: exact_match, weight: 1.0}, {name: 'tests.support.actors:bonus_reward', weight: 1.0}]",
            "trainer.loss.kl_coef=0.1",
            "export_dir=null",
            "reference.follow_every=1",
            "reference.follow_lag=1",
        ],
    )
    return tmp_path / "run", tmp_path, asyncio.run(main(cfg))


def test_grpo_on_a_users_jsonl_task_with_a_column_reward(users_task_run):
    """A user's task: their JSONL with their own column names, a reward of theirs reading an extra column, a
    held-out file, and a prompt too long for the engine (skipped and counted, the run goes on)."""
    run, data, summary = users_task_run
    assert summary["trainer_version"] == 4
    scored = [r for r in read_jsonl(run / "metrics.jsonl") if "reward/tests.support.actors:bonus_reward" in r]
    assert scored and all(r["reward/tests.support.actors:bonus_reward"] == 0.5 for r in scored)
    # 16+ groups from 10 rows: past the first epoch, so the long prompt was met, skipped and counted
    assert summary["data"]["epoch"] >= 1 and summary["drops"]["prompt_too_long"] >= 1
    assert len(summary["evals"]) == 2 and all(0.0 <= acc <= 1.0 for *_, acc in summary["evals"])
    app_state = torch.load(next(run.glob("checkpoints/step-*/app_state.pt")), weights_only=False)
    assert app_state["dataset"]["source"] == str(data / "train.jsonl")
    assert app_state["dataset"]["position"] == summary["data"]["position"]


def test_a_reward_needing_a_missing_column_stops_the_run_at_start(tmp_path):
    (tmp_path / "train.jsonl").write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    cfg = load_config(
        GRPOConfig,
        REPO / "configs/grpo/tiny.yaml",
        SMALL
        + [
            "steps=1",
            f"output_dir={tmp_path}/run",
            f"task.source={tmp_path}/train.jsonl",
            "rewards=[{name: 'tests.support.actors:bonus_reward', weight: 1.0}]",
        ],
    )
    with pytest.raises(ConfigError, match=r"reward 'tests.support.actors:bonus_reward' needs \['bonus'\]"):
        asyncio.run(main(cfg))


def test_trainer_killed_mid_run_then_resumed(tmp_path):
    """In the synchronous loop, SIGKILL the trainer mid-run: the app stops with an error naming the trainer and
    its newest checkpoint, which is intact, and resume=auto continues from it to the end. The resumed run's
    first step trains exactly what the killed run's same step did before the kill (the checkpoint holds the
    buffered batch, weights, optimizer and data position), so the two losses are equal."""
    import contextlib
    import os
    import signal
    import threading
    import time

    import psutil

    from forge_rl.loop.checkpoint import APP_STATE, complete_checkpoints
    from forge_rl.loop.train_loop import RoleDied

    # a checkpoint every second step: the kill lands after step 3 is logged, so the newest checkpoint is step 2
    # and the step the resumed run trains first (3) has a loss from the run that was killed
    run_dir = tmp_path / "run"
    sync = SMALL + [
        "async_mode=false",
        "max_policy_age=0",
        "buffer.drop_zero_advantage=false",
        "checkpoint_every=2",
        "checkpoint_keep_last=0",
        f"output_dir={run_dir}",
        "steps=5",
        "resume=auto",
    ]

    def losses() -> dict[int, float]:
        if not (run_dir / "metrics.jsonl").is_file():
            return {}
        return {r["step"]: r["trainer/loss"] for r in read_jsonl(run_dir / "metrics.jsonl") if "trainer/loss" in r}

    victims = []

    def kill_the_trainer_after_step_3():
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            with contextlib.suppress(ValueError):  # a line caught half-written: read again
                if 3 in losses():
                    break
            time.sleep(0.02)
        for proc in psutil.Process(os.getpid()).children():
            if proc.name() == "forge:Trainer":  # the provisioner names each proc after its role
                victims.append(proc.pid)
                os.kill(proc.pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_the_trainer_after_step_3, daemon=True)
    killer.start()
    with pytest.raises(RoleDied) as died:
        asyncio.run(main(load_config(GRPOConfig, REPO / "configs/grpo/tiny.yaml", sync)))
    killer.join(timeout=5)
    before_kill = losses()
    assert len(victims) == 1
    newest = complete_checkpoints(run_dir / "checkpoints")[-1]
    message = str(died.value)
    assert "Trainer process died" in message and str(newest) in message and "resume=" in message
    assert newest.name == "step-2", (newest, sorted(before_kill))  # it died mid-run, with a checkpoint behind it
    assert not list((run_dir / "checkpoints").glob(".*"))  # no half-written checkpoint left
    assert torch.load(newest / APP_STATE, weights_only=False)["version"] == 2

    resumed = asyncio.run(main(load_config(GRPOConfig, REPO / "configs/grpo/tiny.yaml", sync)))
    assert resumed["start_step"] == 2 and resumed["trainer_version"] == 5
    assert resumed["generator_version"] == 5 and resumed["max_staleness"] == 0
    # the first step after resuming from step 2 trained what the killed run's step 3 did
    assert losses()[3] == pytest.approx(before_kill[3], abs=1e-6)
    assert sorted(losses()) == list(range(1, 6))  # no step twice, none missing
    accounting = resumed["buffer"]
    assert accounting["added"] == accounting["trained"] + sum(accounting["dropped"].values()) + accounting["present"]


def test_resume_takes_true_false_or_auto():
    """What each does with a folder's checkpoints: tests/unit/loop/test_run_folder.py."""
    with pytest.raises(ConfigError, match="resume='sometimes'"):
        load_config(GRPOConfig, REPO / "configs/grpo/tiny.yaml", ["resume=sometimes"])


def test_multi_turn_grpo_masks_the_environments_tokens(tmp_path):
    """GRPO with the retry environment: wrong first answers get feedback and a second turn inside the same
    sequence; the feedback tokens are stored as the environment's (logprob 0, no loss), the model's keep their
    behaviour logprobs, and evaluation counts problems solved within two turns."""
    from transformers import AutoTokenizer

    from forge_rl.types import TrainBatch

    cfg = load_config(
        GRPOConfig,
        REPO / "configs/grpo/tiny_retry.yaml",
        # Groups of equal rewards are kept (not dropped at the buffer's door) so that the checkpoints, which land
        # the rollouts in flight, hold trajectories to read back whatever the tiny model's rewards were.
        SMALL
        + [
            "steps=3",
            f"output_dir={tmp_path}",
            "checkpoint_every=1",
            "env.max_total_tokens=48",
            "buffer.drop_zero_advantage=false",
        ],
    )
    summary = asyncio.run(main(cfg))
    assert summary["trainer_version"] == 3 and summary["max_staleness"] <= 1
    accounting = summary["buffer"]
    assert accounting["added"] == accounting["trained"] + sum(accounting["dropped"].values()) + accounting["present"]
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert any(r.get("reward/turns", 0) > 1 for r in rows)  # some trajectories took a second turn
    assert "eval/first_turn" in rows[0] and rows[0]["eval/accuracy"] >= rows[0]["eval/first_turn"]

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(cfg.model))
    groups = [
        g
        for p in sorted((tmp_path / "checkpoints").glob("step-*"))
        for g, _ in torch.load(p / "app_state.pt", weights_only=False)["buffer"]["entries"]
    ]
    episodes = [e for g in groups for e in g.episodes if e.completion.env_mask.any()]
    assert episodes, "no stored trajectory had an environment turn"
    for e in episodes:
        c = e.completion
        assert len(c.response_ids) <= 48
        feedback = tokenizer.decode(c.response_ids[c.env_mask])
        assert "Wrong. Try again." in feedback and "<|im_start|>assistant" in feedback
        assert (c.logprobs[c.env_mask] == 0).all() and (c.logprobs[~c.env_mask] < 0).any()
        assert e.reward in (0.0, 0.5)  # a retry earns at most the second try's credit
    batch = TrainBatch.collate(episodes, pad_id=0)
    assert batch.num_response_tokens == sum(int((~e.completion.env_mask).sum()) for e in episodes)


async def probe_step(run, shifts: list[float]) -> dict[str, float]:
    """One trainer step on a hand-made batch: 4 rows of 8 prompt and 8 response tokens, advantage +1 each, whose
    behaviour logprobs are the trainer's own logprobs minus `shifts` (repeated along the response), so that the
    token log-ratios log pi - log mu are exactly `shifts`. Returns the trainer's metrics of that step."""
    from forge_rl.types import TrainBatch

    B, P, R = 4, 8, 8
    tokens = torch.randint(3, 100, (B, P + R), generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(B, P + R, dtype=torch.bool)
    mask[:, P:] = True
    batch = TrainBatch(tokens, mask, torch.zeros(B, P + R), torch.where(mask, 0, -1), torch.ones(B))
    logprobs = (await run.roles.trainer.mesh.logprobs.call(batch)).get(0)
    log_ratio = torch.tensor(shifts * (R // len(shifts)))
    batch.behaviour_logprobs[:, P:] = (logprobs[:, P:] - log_ratio).float()
    return (await run.roles.trainer.mesh.step.call([batch])).get(0)


# What only the chosen loss does, on a batch whose ratios are known (probe_step), with advantages +1:
# - gspo: log-ratios +1, -1, ... average to 0 over each sequence, so the sequence ratio is 1 and nothing is
#   clipped; plain grpo clips every token with ratio e (half of them: clip fraction 0.5);
# - cispo: every log-ratio +1 (ratio e, above 1 + clip_high): plain grpo's clipped objective is then a constant
#   and its gradient exactly 0; cispo's stop-gradient weight keeps log pi's gradient (norm > 0).
@pytest.mark.parametrize(
    "config, overrides, shifts",
    [
        (
            "tiny.yaml",
            ["trainer.loss.policy_loss=gspo", "trainer.loss.clip_low=3e-4", "trainer.loss.clip_high=4e-4"],
            [1.0, -1.0],
        ),
        (
            "tiny_dapo.yaml",
            ["trainer.loss.policy_loss=cispo", "trainer.loss.clip_low=1.0", "trainer.loss.clip_high=0.28"],
            [1.0],
        ),
    ],
    ids=["gspo", "cispo-with-dapo-recipe"],
)
def test_gspo_and_cispo_train_in_a_short_grpo_run(tmp_path, config, overrides, shifts):
    from forge_rl.recipes.rl_run import RLRun

    cfg = load_config(
        GRPOConfig,
        REPO / "configs/grpo" / config,
        SMALL + ["steps=2", "eval_size=8", f"output_dir={tmp_path}", *overrides],
    )

    async def body():
        async with RLRun(cfg) as run:
            lines = [await run.rl_step() for _ in range(2)]
            return lines, await probe_step(run, shifts)

    rows, probe = asyncio.run(body())
    assert all(math.isfinite(r["trainer/loss"]) and r["trainer/grad_norm"] > 0 for r in rows)
    if config == "tiny_dapo.yaml":  # the overlong penalty was part of every scored group
        # a step that scored no group (its groups were all scored before the previous step's line) has a NaN mean
        scored = [r for r in rows if not math.isnan(r["reward/mean"])]
        assert scored and all("reward/overlong" in r for r in scored), rows
    assert probe["clip_fraction"] == pytest.approx(1.0 if "cispo" in overrides[0] else 0.0, abs=0.01), probe
    assert probe["grad_norm"] > 1e-4, probe  # grpo: 0 (cispo's probe), or the gspo probe's unclipped half


def test_lora_grpo_on_shared_cores_with_a_kl_penalty_moves_and_syncs_only_the_adapter(tmp_path):
    """The single-device LoRA user: configs/grpo/tiny_lora.yaml shortened, generator and trainer time-sharing
    the cores (the generator is held while the trainer steps), a KL penalty to the frozen base (a reference
    actor fills ref_logprobs). Every version the generator loads is the adapter alone, and the policy moves away
    from the base. That LoRA learns the task is `make demo-lora`'s to show (docs/benchmarks.md: 38.2% -> 61.0%
    held-out in 150 steps): by step 40 it had risen 4 to 13 points depending on the async schedule, and a run
    long enough to assert it took a tenth of CI."""
    from safetensors.torch import load_file

    cfg = load_config(
        GRPOConfig,
        REPO / "configs/grpo/tiny_lora.yaml",
        [
            "steps=4",
            "eval_every=0",
            "eval_size=16",
            f"output_dir={tmp_path}",
            "resources.placement=colocated",
            "trainer.loss.kl_coef=0.01",
        ],
    )
    summary = asyncio.run(main(cfg))
    assert summary["trainer_version"] == 4 and summary["generator_version"] == 4
    assert summary["max_staleness"] <= 1
    rows = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "trainer/loss" in r]
    full = (REPO / "forge_rl/models/tiny_warm/model.safetensors").stat().st_size
    assert all(r["sync/bytes"] < full / 5 for r in rows), rows[-1]  # adapters, never the base
    adapter = load_file(tmp_path / "hf/adapter/adapter_model.safetensors")
    assert adapter and all(".lora_A." in k or ".lora_B." in k for k in adapter)
    kl = [r["trainer/kl_ref"] for r in rows]
    assert abs(kl[0]) < 1e-6 and kl[-1] > 1e-7  # step 1: the policy is the base; then it moves away from it
    assert summary["placement"].startswith("placement colocated")
    assert summary["generator_stats"]["held_s"] > 0  # it stepped aside for each train step
    assert all(r["sync/hold_s"] >= 0 and r["sync/release_s"] >= 0 for r in rows)  # timed every step
    accounting = summary["buffer"]
    assert accounting["added"] == accounting["trained"] + sum(accounting["dropped"].values()) + accounting["present"]


def test_a_grpo_run_with_a_kl_to_a_moving_anchor_records_each_steps_reference_version(users_task_run):
    """reference.follow_every=1, follow_lag=1 (the Reference's own test: tests/integration/test_reference.py):
    steps 1 and 2 are
    scored by the starting policy (after step 1 the anchor would be version 0 again), step 3 by version 1, step 4 by
    version 2; the metrics say so. The run is users_task_run's: the anchor does not care whose task it is."""
    run, _, _ = users_task_run
    rows = [r for r in read_jsonl(run / "metrics.jsonl") if "trainer/loss" in r]
    assert [r["reference/version"] for r in rows] == [0, 0, 1, 2]
    assert all(r["trainer/kl_ref"] >= 0 for r in rows)


def test_long_tailed_lengths_with_requeue_in_a_short_async_run(tmp_path):
    """generator.lengths + stale_in_flight=requeue end to end: every group runs to its drawn length (the filler
    reaches the trainer), the engine's occupancy and the partial rollouts are in the summary, requeued groups are
    ones the generators aborted, and the held-out evaluation still ends at the model's own end of answer."""
    cfg = load_config(
        GRPOConfig,
        REPO / "configs/grpo/tiny.yaml",
        SMALL
        + [
            "steps=4",
            "eval_size=16",
            f"output_dir={tmp_path}",
            "rollout_tasks=4",
            "generator.sampling.max_tokens=64",
            "generator.engine_args.max_model_len=128",
            "generator.lengths.median=12",
            "generator.lengths.min_tokens=6",
            "stale_in_flight=requeue",
        ],
    )
    summary = asyncio.run(main(cfg))
    p, gen = summary["partial_rollouts"], summary["generator_stats"]
    # responses of 6-64 drawn tokens (mean ~19) where the demo's answers are 2-4 tokens and end
    assert p["sequences"] >= 4 * 4 * 4 and gen["generated_tokens"] / p["sequences"] > 10, (p, gen)
    assert 0 < summary["mean_running_sequences"] <= 4 * 4  # at most rollout_tasks groups of 4 in the engine
    assert p["requeued_groups"] <= gen["aborted_too_old"] and summary["trainer_version"] == 4
    steps = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "trainer/loss" in r]
    # the trainer forwarded the filler: far more tokens per episode than prompt + answer
    assert all(r["trainer/tokens_per_s"] * r["trainer/step_s"] / 16 > 30 for r in steps)
    assert 0.0 < summary["evals"][-1][-1] <= 1.0
