"""The Tinker-compatible service: forge_rl's roles behind the HTTP protocol the `tinker` client speaks.

    async with TinkerService(TinkerConfig(model="tiny")) as service:     # or: await service.start() / stop()
        client = tinker.ServiceClient(base_url=service.base_url, api_key=service.api_key)

`python -m apps.tinker.main --config configs/tinker/tiny.yaml` runs one until Ctrl-C; a notebook starts it with
top-level await. Start-up starts the one generator every sampling client shares (vLLM in forge_rl's Generator actor,
serving every training client's adapter at once under LoRA);
each training client starts a trainer of its own (forge_rl/tinker/training.py). The HTTP server runs on this event
loop, and the client's calls run as its tasks while the actors do the work in their processes.
"""

import asyncio
import contextlib
import json
import secrets
import socket
from pathlib import Path

from forge_rl.errors import ConfigError
from forge_rl.models import resolve_model_path
from forge_rl.tinker.config import TinkerConfig
from forge_rl.tinker.sampling import Sampling
from forge_rl.tinker.sessions import Sessions
from forge_rl.tinker.states import States
from forge_rl.tinker.training import Training


class TinkerService:
    def __init__(self, cfg: TinkerConfig):
        self.cfg = cfg
        self.api_key = cfg.api_key or f"tml-forge-rl-{secrets.token_urlsafe(24)}"
        self.keys = {self.api_key: "user-0"}
        self.keys.update({f"tml-forge-rl-{secrets.token_urlsafe(24)}": f"user-{i + 1}" for i in range(cfg.extra_users)})
        self.port: int | None = None
        self.model_dir = ""
        self.generator = self.training = self.sampling = self.states = self.sessions = None
        self._reaper = None
        self._stack = contextlib.AsyncExitStack()
        self._server = self._task = None

    @property
    def base_url(self) -> str:
        return f"http://{self.cfg.host}:{self.port}"

    def capabilities(self) -> dict:
        model = {"model_name": self.cfg.model, "max_context_length": self.cfg.max_sequence_tokens}
        return {"supported_models": [{**model, "trainable": True, "sampleable": True}]}

    def health(self) -> dict:
        """What the service holds: its clients, the saved adapters its one generator serves, its processes, memory."""
        from forge_rl.tinker.usage import process_usage

        clients = len(self.training.models) if self.training else 0
        kept = self.sampling.kept if self.sampling else {}
        adapters = sum(len(vs) for m, vs in kept.items() if m in self.training.models)
        return {"training_clients": clients, "adapters_served": adapters, **process_usage()}

    def info(self, model_id: str) -> dict:
        return {
            "type": "get_info",
            "model_id": model_id,
            "model_data": {"arch": "qwen3", "model_name": self.cfg.model, "tokenizer_id": self.model_dir},
            "is_lora": bool(self.cfg.lora_rank),
            "lora_rank": self.cfg.lora_rank or None,
        }

    def announce(self) -> None:
        """Say where the service listens and its key, on stdout and in output_dir/service.json (owner-only), which a
        script reads to connect."""
        others = [key for key in self.keys if key != self.api_key]
        info = {"base_url": self.base_url, "api_key": self.api_key, "other_users": others, "model": self.cfg.model}
        info["model_path"] = self.model_dir  # the base model's directory: a client loads its tokenizer from it
        path = self._info_file()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch(mode=0o600)
        path.write_text(json.dumps(info) + "\n")
        print(f"forge_rl tinker: serving {self.cfg.model} at {self.base_url} api_key={self.api_key}", flush=True)
        for i, key in enumerate(others, start=1):
            print(f"forge_rl tinker: user-{i} api_key={key}", flush=True)

    def _info_file(self) -> Path:
        return Path(self.cfg.output_dir) / "service.json"

    async def start(self) -> "TinkerService":
        from forge_rl.runtime import provisioned

        try:
            self.model_dir = resolve_model_path(self.cfg.model)
        except FileNotFoundError as e:
            raise ConfigError(f"model={self.cfg.model!r}: {e}") from None
        self._info_file().unlink(missing_ok=True)  # a script must never find the key and port of a stopped run
        try:
            await self._stack.enter_async_context(provisioned(log_dir=Path(self.cfg.output_dir) / "logs"))
            generator_cores, trainer_cores = cpu_options(self.cfg)
            self.generator = await self._start_generator(generator_cores)
            vocab = json.loads((Path(self.model_dir) / "config.json").read_text())["vocab_size"]
            self.training = Training(self.cfg, self.model_dir, vocab, trainer_cores)
            self.sampling = Sampling(self.cfg, self.training, self.generator)
            self.states = States(self.training)
            self.sessions = Sessions(self.training)
            await self._serve()
        except BaseException:
            await self.stop()
            raise
        return self

    async def _start_generator(self, cores: dict):
        from forge_rl.actors.generator import Generator
        from forge_rl.models.lora_config import LoRAConfig

        lora = LoRAConfig(rank=self.cfg.lora_rank, alpha=self.cfg.lora_alpha) if self.cfg.lora_rank else None
        engine_args: dict = {"max_model_len": self.cfg.max_sequence_tokens}
        if lora is not None:  # two saves of every training client in one batch; every kept save loaded, and one more
            clients, kept = self.cfg.max_training_clients, self.cfg.kept_saves
            engine_args.update(max_loras=clients * min(kept, 2), max_cpu_loras=clients * (kept + 1))
        engine_args.update(self.cfg.engine_args)
        return await Generator.options(replicas=1, **cores).as_service(
            self.model_dir, engine_args=engine_args, seed=self.cfg.seed, lora=lora
        )

    async def _serve(self) -> None:
        import uvicorn

        from forge_rl.tinker.server import make_app

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.cfg.host, self.cfg.port))
        except OSError as e:
            sock.close()
            raise ConfigError(
                f"port={self.cfg.port}: cannot listen on {self.cfg.host} ({e}); use 0 for a free port"
            ) from None
        self._stack.callback(sock.close)
        self.port = sock.getsockname()[1]
        self.app = make_app(self, self.keys)
        config = uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="off", timeout_keep_alive=600)
        self._server = _server_without_signals(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                await self._task  # its start-up error
            await asyncio.sleep(0.02)
        self._reaper = asyncio.create_task(self.sessions.reap())

    async def stop(self) -> None:
        """Stop serving, then every actor; safe to call twice."""
        self._info_file().unlink(missing_ok=True)
        if self._reaper is not None:
            self._reaper.cancel()
            self._reaper = None
        if self._server is not None:
            self._server.should_exit = True
            with contextlib.suppress(Exception):
                await self._task
            self._server = None
            await self.app.state.futures.close()
        if self.training is not None:
            await self.training.stop()
            self.training = None
        if self.generator is not None:
            with contextlib.suppress(Exception):
                await self.generator.shutdown()
            self.generator = None
        await self._stack.aclose()

    async def __aenter__(self) -> "TinkerService":
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.stop()


def cpu_options(cfg: TinkerConfig) -> tuple[dict, dict]:
    """The generator's and every trainer's cores on a CPU machine (actor options), as forge_rl's runs place them
    (forge_rl/runtime/placement.py, `resources` of the config): apart when the machine has a core for each, so a
    loop that samples while it trains does not have vLLM's and torch's threads fight over the same cores. Trainers
    of several clients share the trainer's cores. Nothing is pinned on GPUs, or where the roles must share cores."""
    from forge_rl.runtime.placement import plan_placement
    from forge_rl.runtime.provisioner import visible_gpus

    if visible_gpus():
        return {}, {}
    placement = plan_placement(cfg.resources, cfg.trainer_procs, 1, 0)
    if placement.colocated:
        return {}, {}
    generator = dict(cpus=tuple(tuple(c) for c in placement.generator_cpus))
    trainer = dict(cpus=tuple(tuple(c) for c in placement.trainer_cpus), threads=placement.trainer_threads)
    return generator, trainer


def _server_without_signals(config):
    """uvicorn's server without its signal handlers: the app's own Ctrl-C handling stays in place."""
    import uvicorn

    class Server(uvicorn.Server):
        def capture_signals(self):
            return contextlib.nullcontext()

    return Server(config)
