"""What every run shares, whatever it trains: its own copy of the config, a console, an output folder claimed for
it, the hosts its roles run on, a timeline of what each role did, and the start/stop pair (also `async with`).

    class MyRun(RecipeRun):
        def prepare(self): ...             # checks and data, no actor yet; calls self.claim_output(...)
        async def start_roles(self, hosts): ...   # the actors, on the hosts the launcher gave

RLRun (GRPO, PPO and distillation: forge_rl/recipes/rl_run.py) and SFTRun are the two users."""

import abc
import asyncio
import contextlib
import copy
from pathlib import Path

from rich.console import Console

from forge_rl.config import to_yaml
from forge_rl.envs.openenv_server import stop_server
from forge_rl.launch.launcher import run_hosts
from forge_rl.loop.run_folder import RunClaim, claim_output_dir
from forge_rl.observability.timeline import Timeline


class RecipeRun(abc.ABC):
    """A run's shared skeleton. Subclasses define `prepare` and `start_roles`, and may extend `stop`."""

    def __init__(self, cfg):
        # The run's own copy: it fills in derived settings (a model's path, a trainer's temperature), which must
        # not leak into a second run made from the same object (a notebook).
        self.cfg = copy.deepcopy(cfg)
        self.console = Console(soft_wrap=True)  # no hard wraps at 80 columns in a log file
        self.out = Path(cfg.output_dir)
        self.log_dir = None if cfg.verbose else self.out / "logs"
        self.claim: RunClaim | None = None  # this run's id and the checkpoint it resumes from (run_folder.py)
        self.timeline = Timeline()  # each role's busy spans: output_dir/timeline.{json,png}
        self._stack: contextlib.AsyncExitStack | None = None
        self.provisioner = None  # the run's procs, once its hosts are up

    @abc.abstractmethod
    def prepare(self) -> None:
        """Everything that needs no actor: config checks, paths, data, the output folder."""

    @abc.abstractmethod
    async def start_roles(self, hosts: dict) -> None:
        """Start the run's actors on `hosts` (empty: this host) and resume when asked to."""

    def claim_output(self, checkpoint_dir: Path, algorithm: str) -> None:
        """Claim output_dir for this run (or refuse, in one line), say what the claim noticed, and write the
        run's config.yaml beside its outputs."""
        cfg = self.cfg
        self.claim = claim_output_dir(
            self.out,
            checkpoint_dir,
            algorithm=algorithm,
            resume=cfg.resume,
            overwrite=cfg.overwrite,
            steps=cfg.steps,
            export_dir=cfg.export_dir,
        )
        for note in self.claim.notes:
            self.console.print(f"[yellow]{note}[/yellow]")
        (self.out / "config.yaml").write_text(to_yaml(cfg))

    async def start(self):
        """prepare(), the launcher's hosts, then the roles; on any failure everything started is stopped."""
        try:
            self.prepare()
        except BaseException:
            self._stop_owned()  # what a check started before a later one refused the run
            raise
        self._stack = contextlib.AsyncExitStack()
        try:
            hosts, self.provisioner = await self._stack.enter_async_context(
                run_hosts(self.cfg.launcher, self.out, self.log_dir)
            )
            await self.start_roles(hosts)
        except BaseException:
            await self.stop()
            raise
        return self

    async def stop(self) -> None:
        """Every actor and proc of the run gone, with its shared memory, and the processes it owns outside its
        hosts (an OpenEnv server it serves its environment from: env.openenv.serve) (idempotent)."""
        try:
            if self._stack is not None:
                stack, self._stack = self._stack, None
                await asyncio.shield(stack.aclose())
        finally:
            self._stop_owned()

    def _stop_owned(self) -> None:
        """Stop the processes the run owns outside its hosts: its OpenEnv server (env.openenv.serve)."""
        env = getattr(self.cfg, "env", None)  # SFT has none
        if env is not None:
            stop_server(env)

    async def __aenter__(self):
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.stop()
