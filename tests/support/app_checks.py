"""The apps' start-up checks in this process: everything an app does before its first actor (parse the command
line, load the config, the run's prepare()), with the exit status and what it printed, as a user would see them.
Used by tests/integration/test_bad_inputs.py (the table of mistakes) and test_cli_fuzz.py (the schema's leaves)."""

import time
import traceback
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from io import StringIO


class PassedEveryCheck(BaseException):
    """Raised in process where the app would go on to start its first actor. A BaseException, so the app's own
    handling of unexpected errors (a bug's one line) lets it through."""


def checks_only(app: str):
    """The app's schema, and a `main` that runs everything the app does before its first actor (the run's
    prepare(): its start() calls it first), then raises PassedEveryCheck instead of starting actors."""
    from forge_rl.recipes.algorithm import GRPO
    from forge_rl.recipes.distill import DISTILL, DistillConfig
    from forge_rl.recipes.grpo_config import GRPOConfig
    from forge_rl.recipes.ppo import PPO, PPOConfig
    from forge_rl.recipes.rl_run import RLRun
    from forge_rl.recipes.sft import SFTConfig, SFTRun

    schema, make_run = {
        "grpo": (GRPOConfig, lambda cfg: RLRun(cfg, GRPO)),
        "sft": (SFTConfig, SFTRun),
        "ppo": (PPOConfig, lambda cfg: RLRun(cfg, PPO)),
        "distill": (DistillConfig, lambda cfg: RLRun(cfg, DISTILL)),
    }[app]

    async def main(cfg) -> dict:
        make_run(cfg).prepare()
        raise PassedEveryCheck(f"{app}: every check before the actors passed")

    return schema, main


@dataclass
class Checked:
    status: int  # 0: every check passed (the app would start its actors); 2: a user error; 1: a stop or a bug
    seconds: float
    stderr: str
    stdout: str


def check_in_process(app: str, argv: list[str]) -> Checked:
    """`python -m apps.<app>.main ARGV` up to its first actor, in this process. Call it with the stop-signal
    handlers patched out (pytest keeps its own) and FORGE_RL_DEBUG unset."""
    from forge_rl.recipes.command_line import run_from_command_line

    schema, main = checks_only(app)
    stdout, stderr = StringIO(), StringIO()
    start = time.perf_counter()
    with redirect_stdout(stdout), redirect_stderr(stderr):
        try:
            run_from_command_line(schema, main, app, argv)
            status = 0
        except SystemExit as e:
            status = e.code if isinstance(e.code, int) else 1
        except PassedEveryCheck as e:
            status = 0
            print(f"{e}: starting actors", file=stdout)
        except Exception:  # a bug: what the app would print, its traceback
            status = 1
            print(traceback.format_exc(), file=stderr)
    return Checked(status, time.perf_counter() - start, stderr.getvalue(), stdout.getvalue())
