"""The configs under configs/ and the check each must pass: it parses into its app's schema and passes the app's
start-up checks, a required model path given as the user would. tests/unit/test_config.py checks every one but those
whose check imports an optional integration for seconds (a verifiers taskset or an OpenEnv environment class is
loaded to validate it); those are checked beside that integration's tests in tests/integration/."""

from pathlib import Path

from forge_rl.config import load_config
from tests.conftest import REPO

SHIPPED = sorted((REPO / "configs").glob("*/*.yaml"))


def needs(integration: str, path: Path) -> bool:
    """Whether the config sets `integration` (verifiers, openenv): its check imports that package."""
    return f"{integration}:" in path.read_text()


def needs_no_integration(path: Path) -> bool:
    return not any(needs(name, path) for name in ("verifiers", "openenv"))


def app_schema(path: Path):
    from forge_rl.recipes.distill_config import DistillConfig
    from forge_rl.recipes.grpo_config import GRPOConfig
    from forge_rl.recipes.ppo_config import PPOConfig
    from forge_rl.recipes.sft_config import SFTConfig
    from forge_rl.tinker.config import TinkerConfig

    schemas = {"grpo": GRPOConfig, "sft": SFTConfig, "distill": DistillConfig, "ppo": PPOConfig, "tinker": TinkerConfig}
    return schemas[path.parent.name]


def check_shipped_config(path: Path) -> None:
    text = path.read_text()
    overrides = ["model=/models/some-local-dir"] if "???" in text or "oc.env" in text else []
    if "source: ???" in text:  # the task's data is the user's too
        overrides.append("task.source=/data/some-local-dir")
    cfg = load_config(app_schema(path), path, overrides)
    if path.parent.name in ("grpo", "distill", "ppo"):  # distillation and PPO are the GRPO app with a stage more
        from forge_rl.recipes.grpo_checks import check_config, derive_settings

        check_config(cfg)
        derive_settings(cfg)
        assert cfg.trainer.temperature == cfg.generator.sampling.get("temperature", 1.0)
