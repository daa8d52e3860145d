"""The endpoint's listener (forge_rl/agents/http.py): a call's response is not held back by the client's delayed ACK
(its body written after its headers would wait ~40 ms for it on Linux without TCP_NODELAY on the connection), and
the port is released when it stops."""

import asyncio
import socket
import statistics
import time

import httpx

from forge_rl.agents.http import Listener, url_host


def _app():
    from fastapi import FastAPI

    api = FastAPI()

    @api.get("/v1/models")
    async def models():
        return {"data": [{"id": "m"}]}

    return api


def test_a_call_on_a_kept_connection_takes_no_delayed_ack():
    async def run():
        listener = Listener()
        port = await listener.start(_app(), "127.0.0.1", 0)
        seconds = []
        async with httpx.AsyncClient() as http:
            for _ in range(20):
                started = time.perf_counter()
                assert (await http.get(f"http://127.0.0.1:{port}/v1/models")).json() == {"data": [{"id": "m"}]}
                seconds.append(time.perf_counter() - started)
        await listener.stop()
        return port, statistics.median(seconds)

    port, median = asyncio.run(run())
    assert median < 0.02, f"{median * 1e3:.1f} ms a call"  # 40 ms and more when a response waits for an ACK
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", port)) != 0  # nothing listens any more


def test_bound_to_every_interface_its_urls_name_this_host():
    """agent.gateway.host: 0.0.0.0 (agents on the run's other hosts): the URLs handed out name this host, and a call
    to that name is answered."""

    async def run():
        listener = Listener()
        port = await listener.start(_app(), "0.0.0.0", 0)
        try:
            async with httpx.AsyncClient() as http:
                return (await http.get(f"http://{url_host('0.0.0.0')}:{port}/v1/models")).status_code
        finally:
            await listener.stop()

    assert url_host("0.0.0.0") == socket.gethostname() and url_host("10.0.0.5") == "10.0.0.5"
    assert asyncio.run(run()) == 200
