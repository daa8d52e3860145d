"""The environment's own server, as OpenEnv serves any environment (for env.openenv.url):

uvicorn examples.openenv_addition.app:app --host 127.0.0.1 --port 8000
"""

from openenv.core.env_server import create_app

from examples.openenv_addition.env import AdditionAction, AdditionEnvironment, AdditionObservation

app = create_app(AdditionEnvironment, AdditionAction, AdditionObservation, max_concurrent_envs=256)
