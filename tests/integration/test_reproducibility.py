"""A seeded synchronous GRPO run is reproducible: the same config gives bitwise-equal losses and grad norms (fp32 on
CPU), and a run stopped at step k and resumed from its checkpoint goes on exactly as the uninterrupted run did.

Four launches of the app, shared by the tests: the uninterrupted run (STEPS steps), and a second run stopped at
step K then resumed to STEPS. Its first K steps are the second seeded run; its later ones the resumed run. Then
that run as a kill during its finish would leave it (its last checkpoint written, no export or summary.json yet),
resumed once more: it finishes."""

import asyncio
import shutil

import pytest
from safetensors.torch import load_file

from forge_rl.config import load_config
from forge_rl.observability.metrics import read_jsonl
from forge_rl.recipes.grpo import GRPOConfig, main
from tests.conftest import REPO
from tests.support.seeded_sync import SEEDED_SYNC

STEPS, K = 4, 2
SEEDED_SYNC_NO_EVAL = [*SEEDED_SYNC, "eval_size=0", "eval_every=0"]


def launch(out, steps: int, *extra: str) -> dict:
    cfg = load_config(
        GRPOConfig,
        REPO / "configs/grpo/tiny.yaml",
        SEEDED_SYNC_NO_EVAL + [f"steps={steps}", f"output_dir={out}", *extra],
    )
    return asyncio.run(main(cfg))


def trained(out) -> dict[int, tuple]:
    """step -> (loss, grad norm, reward), as the run's metrics recorded them (the last record of a step)."""
    rows = [r for r in read_jsonl(out / "metrics.jsonl") if "trainer/loss" in r]
    return {r["step"]: (r["trainer/loss"], r["trainer/grad_norm"], r.get("reward/mean")) for r in rows}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    whole, stopped = tmp_path_factory.mktemp("whole"), tmp_path_factory.mktemp("stopped")
    launch(whole, STEPS)
    launch(stopped, K, "export_dir=null")
    before_resume = trained(stopped)
    resumed = launch(stopped, STEPS, "resume=true")
    exported = load_file(next((stopped / "hf").glob("*.safetensors")))
    # then as if killed during its finish, after its last checkpoint: no summary.json, no export yet
    (stopped / "summary.json").unlink()
    shutil.rmtree(stopped / "hf")
    finished = launch(stopped, STEPS, "resume=auto")
    return whole, stopped, before_resume, resumed, exported, finished


def test_two_seeded_runs_train_the_same_steps(runs):
    whole, _, before_resume, *_ = runs
    assert sorted(before_resume) == list(range(1, K + 1))
    assert {s: trained(whole)[s] for s in before_resume} == before_resume  # bitwise: floats compared with ==


def test_a_resumed_run_goes_on_as_the_uninterrupted_one(runs):
    whole, stopped, _, resumed, *_ = runs
    assert resumed["start_step"] == K
    after = {s: v for s, v in trained(stopped).items() if s > K}
    assert sorted(after) == list(range(K + 1, STEPS + 1))
    assert after == {s: trained(whole)[s] for s in after}
    # and ends with the same weights, bit for bit
    final, other = (load_file(next((out / "hf").glob("*.safetensors"))) for out in (whole, stopped))
    assert final.keys() == other.keys() and all(final[k].equal(other[k]) for k in final)


def test_a_run_killed_after_its_last_checkpoint_is_finished_by_its_resume(runs):
    _, stopped, _, _, exported, finished = runs
    assert finished["start_step"] == STEPS and finished["steps"] == STEPS  # trained nothing more
    assert (stopped / "summary.json").exists() and finished["evals"]  # the last evaluation ran
    again = load_file(next((stopped / "hf").glob("*.safetensors")))
    assert again.keys() == exported.keys() and all(again[k].equal(exported[k]) for k in again)
