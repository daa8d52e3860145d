from forge_rl.envs.base import ENVIRONMENTS, EnvConfig, Environment, EnvStep, env_factory

__all__ = ["ENVIRONMENTS", "EnvConfig", "Environment", "EnvStep", "env_factory"]
