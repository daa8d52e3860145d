"""What forge_rl uses of its dependencies beyond their public APIs (forge_rl/deps, docs/stack.md) is still there
and still what forge_rl relies on. A new release of Monarch, TorchTitan or vLLM that moves one of these fails
here, by name, instead of deep inside a run."""

import inspect
import subprocess
import sys
from importlib.metadata import version

import pytest
import torch

PINNED = {"torchmonarch": "0.7.0", "torchtitan": "0.3.0", "torch": "2.13.0"}
RECHECK = "a new release: re-check every name in forge_rl/deps and the inventory in docs/stack.md, then pin it"


@pytest.mark.parametrize("package", sorted(PINNED))
def test_the_pinned_versions_are_installed(package):
    assert version(package).split("+")[0] == PINNED[package], f"{package} {version(package)} is installed: {RECHECK}"


def test_the_pinned_vllm_is_installed():
    import vllm

    assert vllm.__version__.split("+")[0] == "0.32.0", f"vllm {vllm.__version__} is installed: {RECHECK}"


def test_monarch_names():
    from monarch.actor import Actor, concurrent_endpoint, endpoint

    from forge_rl.deps import monarch

    assert issubclass(monarch.SupervisionError, Exception)

    class Probe(Actor):
        @endpoint
        async def plain(self, x: int) -> int:
            return x

        @concurrent_endpoint
        async def concurrent(self, x: int) -> int:
            return x

    assert isinstance(Probe.plain, monarch.EndpointProperty)
    assert isinstance(Probe.concurrent, monarch.ConcurrentEndpointProperty)
    assert isinstance(Probe.concurrent, monarch.EndpointProperty)
    # the reply ports run the method itself: for both kinds, the function the class defined
    assert monarch.endpoint_function(Probe.plain).__qualname__.endswith("Probe.plain")
    assert monarch.endpoint_function(Probe.concurrent).__qualname__.endswith("Probe.concurrent")
    assert inspect.isclass(monarch.ActorMesh)
    assert monarch.in_batch_job() is False  # not inside Monarch's sbatch job


def test_monarch_slurm_job_internals():
    from monarch.job import SlurmJob

    from forge_rl.deps import monarch
    from forge_rl.launch.slurm import SlurmHosts

    reader = getattr(SlurmJob, monarch.SLURM_JOB_READER)
    assert list(inspect.signature(reader).parameters) == ["self", "job_id"]
    assert SlurmHosts.__dict__.get(monarch.SLURM_JOB_READER) is not None  # forge_rl's override is the one used
    # A SlurmJob sets Monarch's transport for the whole process when made: in a process of its own.
    probe = (
        "from monarch.job import SlurmJob; from forge_rl.deps.monarch import slurm_job_id; "
        "job = SlurmJob(meshes={'trainer': 1}, job_name='probe'); job._slurm_job_id = '4242'; "
        "print(slurm_job_id(job))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split()[-1] == "4242", out.stdout + out.stderr


def test_torchtitan_names():
    from forge_rl.deps import torchtitan

    import torchtitan.tools.utils as utils

    assert utils.device_type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert callable(torchtitan.build_qwen3_layers) and callable(torchtitan.qwen3_norm)
    # the keyword arguments forge_rl/models/qwen3.py passes
    params = set(inspect.signature(torchtitan.build_qwen3_layers).parameters)
    assert {"n_layers", "dim", "n_heads", "n_kv_heads", "head_dim", "hidden_dim", "attn_backend", "rope"} <= params
    assert list(inspect.signature(torchtitan.qwen3_norm).parameters) == ["dim"]
    assert torchtitan.EMBEDDING_INIT is not None and torchtitan.LINEAR_INIT is not None


def test_vllm_names():
    from forge_rl.deps import vllm

    llm = vllm.async_llm()
    for method in (
        "from_vllm_config",
        "generate",
        "pause_generation",
        "resume_generation",
        "collective_rpc",
        "add_lora",
        "remove_lora",
        "sleep",
        "wake_up",
    ):
        assert hasattr(llm, method), f"AsyncLLM.{method}: {RECHECK}"
    assert issubclass(vllm.engine_dead_error(), Exception)
    assert vllm.engine_context().name == "ENGINE_CONTEXT"


def test_the_engine_args_checked_without_vllm_are_vllms():
    """The names a config's engine_args may use without vLLM being imported to check them are all engine
    arguments; a misspelt one is refused with the right name."""
    from forge_rl.deps import vllm
    from forge_rl.errors import ConfigError

    assert vllm.COMMON_ENGINE_ARGS <= vllm.engine_arg_names(), f"not AsyncEngineArgs fields: {RECHECK}"
    vllm.check_engine_args({"max_model_len": 128, "max_logprobs": 1}, "generator.engine_args")
    with pytest.raises(
        ConfigError,
        match=r"generator\.engine_args\.max_model_length is not a vLLM engine argument; "
        r"did you mean 'max_model_len'",
    ):
        vllm.check_engine_args({"max_model_length": 128}, "generator.engine_args")


def test_pytorch_names(tmp_path):
    """A DTensor sharded over a one-rank mesh: its shard is the whole tensor, at offset 0."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from forge_rl.deps.pytorch import local_shape_and_global_offset

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        d = distribute_tensor(torch.arange(12.0).view(3, 4), mesh, [Shard(0)])
        assert local_shape_and_global_offset(d) == ((3, 4), (0, 0))
    finally:
        dist.destroy_process_group()


def test_pytorch_names_of_the_rehearsal():
    """What forge_rl/rehearsal runs a rank with: the fake process group (rank 3 of 8, collectives that move
    nothing), fake tensors whose storages count their bytes, the storages of a DTensor, DTensor's caches, and the
    name activation checkpointing adds to parameters."""
    import torch.distributed as dist
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from forge_rl.deps import pytorch

    dist.init_process_group(pytorch.FAKE_BACKEND, store=pytorch.fake_store(), rank=3, world_size=8)
    try:
        assert (dist.get_rank(), dist.get_world_size()) == (3, 8)
        with pytorch.fake_tensor_mode():
            t = torch.empty(1000, 1000)
            dist.all_reduce(t)
        assert pytorch.is_fake(t) and not pytorch.is_fake(torch.empty(1))
        assert {s.nbytes() for s in pytorch.untyped_storages(t)} == {4_000_000}
        d = distribute_tensor(torch.zeros(16, 4), init_device_mesh("cpu", (8,)), [Shard(0)])
        assert [s.nbytes() for s in pytorch.untyped_storages(d)] == [2 * 4 * 4]  # rank 3's two rows
        pytorch.forget_dtensor_caches()
    finally:
        dist.destroy_process_group()
    wrapped = torch.nn.Sequential(checkpoint_wrapper(torch.nn.Linear(2, 2)))
    names = [pytorch.state_dict_name(n) for n, _ in wrapped.named_parameters()]
    assert names == list(wrapped.state_dict()) == ["0.weight", "0.bias"]


def qwen3_folders(tmp_path) -> list:
    """Every shipped model, a Qwen3 folder naming each tokenizer class the direct path takes, and one naming another
    class, which it leaves to AutoTokenizer."""
    import json
    import shutil

    from tests.conftest import REPO

    shipped = sorted(
        p.parent
        for p in (REPO / "forge_rl/models").glob("*/tokenizer_config.json")
        if json.loads((p.parent / "config.json").read_text())["model_type"] in ("qwen3", "qwen3_moe")
    )  # the Qwen3 ones: tiny-vlm (Idefics3) goes through AutoTokenizer
    made = []
    for named, extra in [("Qwen2Tokenizer", {}), ("Qwen2TokenizerFast", {}), ("TokenizersBackend", {}),
                         ("GPT2Tokenizer", {})]:  # fmt: skip
        folder = tmp_path / named
        shutil.copytree(shipped[0], folder, ignore=shutil.ignore_patterns("*.safetensors"))
        tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(
            json.dumps({**tokenizer_config, "tokenizer_class": named, **extra})
        )
        made.append(folder)
    return shipped + made


def test_the_direct_tokenizer_is_the_one_auto_tokenizer_loads(tmp_path):
    """forge_rl/deps/transformers.py picks AutoTokenizer's class itself for Qwen3 folders: the same class, tokens,
    special tokens and chat template as AutoTokenizer, or AutoTokenizer's own answer where it does not pick."""
    import json

    from transformers import AutoTokenizer

    from forge_rl.deps.transformers import auto_tokenizer, direct_tokenizer_class

    chat = [{"role": "user", "content": "What is 12 + 30?"}]
    picked = []
    for folder in qwen3_folders(tmp_path):
        ours, theirs = auto_tokenizer(folder), AutoTokenizer.from_pretrained(folder)
        picked.append(direct_tokenizer_class(folder))
        assert type(ours) is type(theirs), (folder.name, type(ours), type(theirs))
        assert ours.get_vocab() == theirs.get_vocab() and ours.all_special_tokens == theirs.all_special_tokens
        assert (ours.pad_token_id, ours.eos_token_id, ours.bos_token_id) == (
            theirs.pad_token_id,
            theirs.eos_token_id,
            theirs.bos_token_id,
        )
        text = ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert text == theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert ours(text)["input_ids"] == theirs(text)["input_ids"] and ours.decode([5, 6, 7]) == theirs.decode(
            [5, 6, 7]
        )
    assert picked[-4:] == ["Qwen2Tokenizer", "Qwen2Tokenizer", "TokenizersBackend", None]
    assert all(picked[:-4])  # every shipped model takes the direct path
    remote = tmp_path / "Qwen2Tokenizer"  # naming its own code: AutoTokenizer's (it asks for trust_remote_code)
    config = json.loads((remote / "tokenizer_config.json").read_text())
    (remote / "tokenizer_config.json").write_text(json.dumps({**config, "auto_map": {"AutoTokenizer": ["t.T", None]}}))
    assert direct_tokenizer_class(remote) is None


def test_a_qwen3_tokenizer_loads_without_importing_the_auto_classes():
    from tests.conftest import TINY_MODEL

    code = (
        "import sys; from forge_rl.deps.transformers import auto_tokenizer; auto_tokenizer(sys.argv[1]); "
        "print(sorted(m for m in sys.modules if m in ('torch', 'transformers.models.auto.tokenization_auto')))"
    )
    out = subprocess.run([sys.executable, "-c", code, str(TINY_MODEL)], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_the_tiny_vlm_processor_loads_without_transformers_default_config_warning():
    """transformers 5.19 warns of its own default Idefics3 config's pad_token_id while loading the processor
    (`AutoProcessor.from_pretrained` on tiny-vlm prints it); the load through forge_rl/deps/transformers.py says
    nothing. A fresh process: transformers logs the warning once per process."""
    from forge_rl.models import resolve_model_path

    code = f"from forge_rl.data.vision import load_processor; load_processor({resolve_model_path('tiny-vlm')!r})"
    said = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert said.stderr.strip() == "" and said.stdout.strip() == "", said.stderr
