import pytest
import torch

from forge_rl.actors.generator_engine import CPU_ENGINE_DEFAULTS, eager_helpers


@pytest.fixture
def default_stance():
    yield
    torch.compiler.set_stance("default")


def compiled_count():
    """A torch.compile'd function (a comparison and a sum, as vLLM's logprob rank helper) and the list of graphs its
    backend was asked to compile."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    return torch.compile(lambda x, v: (x >= v).sum(-1), backend=backend), graphs


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_an_eager_cpu_engine_runs_compiled_helpers_eagerly(default_stance, enforce_eager):
    eager_helpers({**CPU_ENGINE_DEFAULTS, "enforce_eager": enforce_eager})
    fn, graphs = compiled_count()
    x = torch.tensor([[0.1, 0.5, 0.3], [0.9, 0.2, 0.4]])
    assert fn(x, x[:, 1:2]).tolist() == [1, 3]
    assert len(graphs) == (0 if enforce_eager else 1)  # an engine asked to compile keeps torch.compile
