"""A verifiers environment trained through the run's endpoint (agent.verifiers, forge_rl/agents/verifiers_env.py),
against the real verifiers package, openai client, vLLM and TorchTitan: one synchronous fp32 GRPO run on tiny-warm
of examples/verifiers_addition, two steps, shared by the tests here. Its episodes are verifiers' own rollouts (its
harness's calls through each episode's URL, scored by the taskset's `correct` reward); that reward is what the
groups train on; and the trainer's logprobs of the episodes' tokens match the engine's (the engine's tokens)."""

import asyncio
import socket

import pytest

from examples.verifiers_addition.taskset import parse_answer
from forge_rl.config import load_config
from forge_rl.recipes.grpo_config import GRPOConfig
from forge_rl.recipes.rl_run import RLRun
from tests.conftest import REPO
from tests.support.agent_runs import SMALL_SYNC_RUN


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The shared run: started, two synchronous steps taken. Yields (event loop, run, the steps' lines)."""
    out = tmp_path_factory.mktemp("verifiers")
    cfg = load_config(
        GRPOConfig,
        REPO / "configs/grpo/tiny.yaml",
        [
            f"output_dir={out}",
            "agent.verifiers.env=examples.verifiers_addition",
            "agent.verifiers.args.size=64",
            "agent.verifiers.held_out_args.split=test",
            "agent.verifiers.held_out_args.size=4",
            "steps=2",
            *SMALL_SYNC_RUN,
        ],
    )
    loop = asyncio.new_event_loop()
    grpo = RLRun(cfg)
    loop.run_until_complete(grpo.start())
    try:
        lines = [loop.run_until_complete(grpo.rl_step()) for _ in range(2)]
        yield loop, grpo, lines
    finally:
        port = grpo.agents.server.port if grpo.agents else None
        loop.run_until_complete(grpo.stop())
        loop.close()
        if port is not None:  # nothing left listening
            with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                pass


def test_an_episode_is_verifiers_rollout_on_its_url_scored_by_its_reward_function(run):
    loop, grpo, _ = run
    example = grpo.held_out[0]
    assert example.messages == [{"role": "user", "content": example.columns["vf_task"]["prompt"]}]
    record, reward = loop.run_until_complete(grpo.agents.episode(example, trained=False))
    assert record.calls == 1 and record.final_text is not None  # verifiers' harness called the episode's URL
    expected = float(parse_answer(record.final_text) == example.answer)  # the taskset's rubric, on that reply
    assert reward == expected and record.reward_parts == {"correct": expected}


def test_the_rubrics_rewards_train_on_the_engines_tokens(run):
    _, _, lines = run
    for line in lines:
        assert line["reward/agent_calls"] >= 1
        assert line["reward/correct"] == pytest.approx(line["reward/mean"])  # one reward function, weight 1
        # synchronous fp32 on both sides: the trained tokens are the engine's (the bound test_mismatch.py holds)
        assert line["trainer/mismatch_abs_mean"] < 1e-4 and line["trainer/mismatch_abs_max"] < 1e-3
