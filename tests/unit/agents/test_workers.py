"""The controller's side of the agent workers (forge_rl/agents/workers.py) where no process is needed: a pool with
no worker up, and none starting, stops the run in one line instead of dropping group after group."""

import asyncio

import pytest

from forge_rl.agents.config import AgentConfig
from forge_rl.agents.workers import AgentWorkers
from forge_rl.errors import RunStopped


def test_a_pool_with_no_worker_left_stops_the_run_in_one_line():
    agent = AgentConfig(entry="examples.agents.retry_agent:solve", workers=2, episodes_per_worker=1)
    workers = AgentWorkers(agent, "tiny-warm")  # not started: no worker is up, none is being replaced
    with pytest.raises(RunStopped) as e:
        asyncio.run(workers.run(None, "http://127.0.0.1:1/episodes/t0/v1", "key"))
    assert "every agent worker died" in str(e.value) and "\n" not in str(e.value)
    assert [slot.name for slot in workers.slots] == ["AgentWorker-0", "AgentWorker-1"]
