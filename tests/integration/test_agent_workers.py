"""Agent episodes played by agent-worker processes (forge_rl/agents/worker.py, workers.py) against the endpoint's
gateway process (forge_rl/agents/gateway.py), both off the controller: one synchronous GRPO run on tiny-warm whose
agent is a program (agent.command, `PROGRAM` below: plain HTTP, one call) played by two workers, shared by every
test here. Its step trains on episodes none of which ran, or was served, in the controller; a program's failure in
a worker comes back as its one line; a worker SIGKILLed in the middle of its episodes is named in one line and
replaced, its group dropped and counted (never trained on half-recorded), the programs it ran stopped, and the next
group trains; the same for the gateway, whose port is released with it; the gateway takes each episode's key."""

import asyncio
import dataclasses
import os
import signal
import socket
import sys
import time
from pathlib import Path

import httpx
import pytest

from forge_rl.agents.command import LOG_NAME
from forge_rl.agents.gateway_client import LOST as GATEWAY_LOST
from forge_rl.agents.gateway_client import GatewayClient
from forge_rl.agents.gateways import Gateways
from forge_rl.agents.workers import LOST, AgentWorkers
from forge_rl.config import load_config
from forge_rl.loop.rollout import DropLog, RolloutStats
from forge_rl.recipes.grpo_config import GRPOConfig
from forge_rl.recipes.rl_run import RLRun
from tests.conftest import REPO
from tests.support.agent_runs import SMALL_SYNC_RUN

# the run's agent: one chat call, then what the row's `script` column asks (sleep that long, or exit 3); its reward
# says whether its parent, the process that ran it, is not the controller
PROGRAM = """import json, os, sys, time, urllib.request
row = json.load(sys.stdin)
request = urllib.request.Request(os.environ['OPENAI_BASE_URL'] + '/chat/completions',
    data=json.dumps({'model': 'm', 'messages': row['messages']}).encode(),
    headers={'Content-Type': 'application/json', 'Authorization': 'Bearer ' + os.environ['OPENAI_API_KEY']})
json.load(urllib.request.urlopen(request))
script = row['columns'].get('script', 0)
if script == 'exit':
    print('no sandbox here', file=sys.stderr)
    sys.exit(3)
time.sleep(float(script))
print(json.dumps(float(os.getppid() != row['columns'].get('controller', 0))))
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The shared run: started with two agent workers, one synchronous step taken. Yields (loop, run, line,
    the program's path)."""
    out = tmp_path_factory.mktemp("agent_workers")
    program = out / "agent_program.py"
    program.write_text(PROGRAM)
    cfg = load_config(
        GRPOConfig,
        REPO / "configs/grpo/tiny.yaml",
        [
            f"output_dir={out}",
            f"agent.command=[{sys.executable}, {program}]",
            "agent.workers=2",
            "agent.episodes_per_worker=4",
            "steps=1",
            *SMALL_SYNC_RUN,
        ],
    )
    loop = asyncio.new_event_loop()
    grpo = RLRun(cfg)
    loop.run_until_complete(grpo.start())
    try:
        line = loop.run_until_complete(grpo.rl_step())
        yield loop, grpo, line, program
    finally:
        pids = [slot.pid for slot in grpo.agents.entry.slots] + [grpo.agents.server.pid] if grpo.agents else []
        port = grpo.agents.server.port if grpo.agents else None
        loop.run_until_complete(grpo.stop())
        loop.close()
        assert not _alive(pids)  # the workers and the gateway stop with the run
        if port:
            assert not _listening(port)


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def _alive(pids: list[int], wait_s: float = 10) -> list[int]:
    """Those of `pids` still running (not zombies) after `wait_s` seconds at most to end."""
    for _ in range(int(wait_s * 10)):
        left = [p for p in pids if _running(p)]
        if not left:
            return []
        time.sleep(0.1)
    return left


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False


def _programs(program: Path) -> list[int]:
    """The pids of the agent programs running now."""
    found = []
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and str(program).encode() in (p / "cmdline").read_bytes():
                found.append(int(p.name))
        except OSError:
            pass
    return found


def test_the_step_trains_on_episodes_played_by_the_workers(run):
    _, grpo, line, _ = run
    workers = grpo.agents.entry
    assert isinstance(workers, AgentWorkers) and len(workers.slots) == 2
    pids = {slot.pid for slot in workers.slots}
    assert os.getpid() not in pids and len(pids) == 2 and all(_running(p) for p in pids)
    assert set(workers.played) <= pids and sum(workers.played.values()) >= 4  # batch_groups x group_size
    assert line["reward/agent_calls"] >= 1 and line["reward/mean"] == 1.0  # no program's parent is the controller
    assert not grpo.agents.server.episodes
    gateway = grpo.agents.server  # the endpoint: a process of its own, neither the controller nor a worker
    assert isinstance(gateway, GatewayClient) and gateway.pid not in pids | {os.getpid(), 0} and _running(gateway.pid)
    stats, _ = run[0].run_until_complete(gateway.call_counts())
    assert stats.calls >= 4  # every call of the step's episodes answered there


def _group(run, script, kill=None):
    """A group of 2 episodes of the dataset's next example, its row's `script` set; `kill(workers)` called once
    both episodes have made their call. (Group or None, stats, lines)."""
    loop, grpo, _, _ = run
    runner = grpo.agents
    example = loop.run_until_complete(grpo.roles.dataset.next.call_one())
    example = dataclasses.replace(example, columns={**example.columns, "script": script, "controller": os.getpid()})
    lines: list[str] = []
    stats = RolloutStats(drop_log=DropLog(write=lines.append))

    async def play():
        task = asyncio.ensure_future(runner.group(example, 2, grpo.roles.reward, stats))
        while kill is not None and (await runner.server.call_counts())[1] < 2:
            await asyncio.sleep(0.05)
        if kill is not None:
            await asyncio.sleep(1.0)  # the worker's reaper has seen its programs (it looks every 0.5 s)
            kill(runner.entry)
        return await task

    return loop.run_until_complete(play()), stats, lines


def test_a_programs_failure_in_its_worker_is_one_line(run):
    group, stats, lines = _group(run, "exit")
    assert group is None and stats.drops["agent_error"] == 2
    assert len(lines) == 1 and "status 3; its last stderr line: no sandbox here" in lines[0], lines
    assert "no sandbox here" in (Path(run[1].log_dir) / LOG_NAME).read_text()  # its stderr in the run's logs


def test_a_killed_worker_is_named_replaced_and_its_group_dropped(run):
    loop, grpo, _, program = run
    workers, said = grpo.agents.entry, []
    workers.write = said.append
    killed = workers.slots[0].pid
    group, stats, lines = _group(run, 60, kill=lambda w: os.kill(killed, signal.SIGKILL))
    assert group is None and stats.drops[LOST] == 2 and workers.lost == 1  # half-recorded: never trained on
    assert len(lines) == 1 and f"({LOST})" in lines[0], lines
    assert len(said) == 1 and f"agent worker 0 (pid {killed}) died" in said[0] and "\n" not in said[0], said
    assert not grpo.agents.server.episodes and not _alive([killed])
    left = _alive(_programs(program), wait_s=30)  # the killed worker's program, and the other's, cancelled
    assert not left, [Path(f"/proc/{p}/status").read_text().splitlines()[:8] for p in left]
    deadline = time.monotonic() + 120
    while not workers.slots[0].healthy and time.monotonic() < deadline:
        loop.run_until_complete(asyncio.sleep(0.2))
    assert workers.slots[0].healthy and workers.slots[0].pid not in (killed, 0)
    played = workers.played[workers.slots[0].pid]
    group, stats, lines = _group(run, 0)  # the new worker plays its part of the next group
    assert group is not None and not lines and workers.played[workers.slots[0].pid] == played + 1


def test_the_gateway_takes_each_episodes_key_only(run):
    """A call without its episode's key, or with another's, is a 401 and never recorded; the root URL takes the
    run's key."""
    loop, grpo, _, _ = run
    gateway = grpo.agents.server
    body = {"model": "m", "messages": [{"role": "user", "content": "12+34="}]}

    async def calls():
        mine, other = await gateway.open(None, True), await gateway.open(None, True)
        url = gateway.base_url(mine)
        async with httpx.AsyncClient(timeout=60) as http:
            codes = [
                (await http.post(f"{url}/chat/completions", json=body, headers=h)).status_code
                for h in ({}, {"Authorization": f"Bearer {other.key}"}, {"Authorization": f"Bearer {gateway.run_key}"})
            ]
            refused = await http.get(f"{gateway.base_url()}/models", headers={"Authorization": f"Bearer {mine.key}"})
            root = await http.get(
                f"{gateway.base_url()}/models", headers={"Authorization": f"Bearer {gateway.run_key}"}
            )
            served = await http.post(
                f"{url}/chat/completions", json=body, headers={"Authorization": f"Bearer {mine.key}"}
            )
        return codes, refused, root, served, await gateway.close(mine), await gateway.close(other)

    codes, refused, root, served, mine, other = loop.run_until_complete(calls())
    assert codes == [401, 401, 401] and refused.status_code == 401 and "run's key" in refused.text
    assert root.status_code == 200 and served.status_code == 200
    assert mine.calls == 1 and other.calls == 0 and mine.failure is None and mine.replicas == {0}


def test_several_gateways_spread_the_episodes_and_keep_each_on_its_own(run):
    """agent.gateway.replicas: 2: two gateway processes on two ports, each episode opened on the one with fewer
    open and served only there (the other refuses its key), one key of the run at every root URL, episode ids
    unique across them, and both ports released when they stop."""
    loop, grpo, _, _ = run
    body = {"model": "m", "messages": [{"role": "user", "content": "12+34="}]}
    settings = grpo.agents.server.settings

    async def calls():
        gateways = await Gateways(grpo.model_dir, settings, grpo.roles.generator, grpo.tokenizer, replicas=2).start()
        ports, pids = [g.port for g in gateways.members], gateways.pids
        try:
            episodes = [await gateways.open(None, True) for _ in range(4)]
            urls = [gateways.base_url(e) for e in episodes]
            async with httpx.AsyncClient(timeout=60) as http:
                served = [
                    (await http.post(f"{u}/chat/completions", json=body, headers=_key(e))).status_code
                    for e, u in zip(episodes, urls)
                ]
                # episode 0's key at episode 1's gateway, under episode 0's own id: not that gateway's episode
                elsewhere = urls[1].replace(f"/episodes/{episodes[1].id}/", f"/episodes/{episodes[0].id}/")
                crossed = await http.post(f"{elsewhere}/chat/completions", json=body, headers=_key(episodes[0]))
                roots = [
                    (await http.get(f"{g.base_url()}/models", headers={"Authorization": f"Bearer {gateways.run_key}"}))
                    for g in gateways.members
                ]
            records = [await gateways.close(e) for e in episodes]
            stats, still_open = await gateways.call_counts()
        finally:
            await gateways.stop()
        return ports, pids, episodes, urls, served, crossed, roots, records, stats, still_open

    ports, pids, episodes, urls, served, crossed, roots, records, stats, still_open = loop.run_until_complete(calls())
    assert len(set(ports)) == 2 and len(set(pids)) == 2 and grpo.agents.server.pid not in pids
    assert [int(u.split(":")[2].split("/")[0]) for u in urls] == [ports[0], ports[1], ports[0], ports[1]]
    assert len({e.id for e in episodes}) == 4  # no id given twice, though each gateway counts its own
    assert served == [200] * 4 and crossed.status_code in (401, 404) and all(r.status_code == 200 for r in roots)
    assert [r.calls for r in records] == [1, 1, 1, 1] and stats.calls == 4 and still_open == 0
    assert not any(_listening(p) for p in ports) and not _alive(pids)


def _key(episode) -> dict:
    return {"Authorization": f"Bearer {episode.key}"}


def test_a_killed_gateway_is_named_replaced_and_its_group_dropped(run):
    loop, grpo, _, program = run
    gateway, said = grpo.agents.server, []
    gateway.write = said.append
    killed, port = gateway.pid, gateway.port
    group, stats, lines = _group(run, 60, kill=lambda w: os.kill(killed, signal.SIGKILL))
    assert group is None and stats.drops[GATEWAY_LOST] == 2 and gateway.lost == 1  # no half-recorded episode trains
    assert len(lines) == 1 and f"({GATEWAY_LOST})" in lines[0], lines
    assert len(said) == 1 and f"agent gateway (pid {killed}) died" in said[0] and "\n" not in said[0], said
    assert not gateway.episodes and not _alive([killed])
    deadline = time.monotonic() + 120
    while not gateway.healthy and time.monotonic() < deadline:
        loop.run_until_complete(asyncio.sleep(0.2))
    assert gateway.healthy and gateway.pid not in (killed, 0)
    assert port == gateway.port or not _listening(port)  # nothing of the killed one listens
    left = _alive(_programs(program), wait_s=30)  # the programs of the dropped group are stopped
    assert not left
    group, stats, lines = _group(run, 0)  # the new gateway serves the next group
    assert group is not None and not lines
