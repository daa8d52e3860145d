"""The trainer's step code on one device in this process, and the dtypes that reach its norms and matmuls: what the
precision tests share (tests/unit/actors/test_trainer_precision.py on CPU, tests/gpu/test_gpu.py on CUDA)."""

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from forge_rl.actors.trainer_config import TrainerConfig
from forge_rl.actors.train_model import TrainModel
from forge_rl.models import qwen3, resolve_model_path

MATMULS = {"aten.mm.default", "aten.addmm.default", "aten.bmm.default"}


class NormDtypes(TorchFunctionMode):
    """(input dtype, weight dtype) of every rms_norm call, as the norm module hands them to torch."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (F.rms_norm, torch.rms_norm):
            weight = args[2] if len(args) > 2 else (kwargs or {}).get("weight")
            self.seen.append((args[0].dtype, weight.dtype))
        return func(*args, **(kwargs or {}))


class MatmulDtypes(TorchDispatchMode):
    """(operand dtypes, output columns) of every matmul as it runs, after autocast's casts; not the fused head's
    per-row dot product of its fp32 probabilities and logits (the entropy, [n, 1, 1]), an fp32 reduction by design."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if str(func) in MATMULS and tuple(out.shape[-2:]) != (1, 1):
            operands = [a for a in args if isinstance(a, torch.Tensor)][-2:]
            self.seen.append((tuple(a.dtype for a in operands), out.shape[-1]))
        return out


def trainer_step(dtype: str, share_prompts: bool, device: str = "cpu", model: str = "tiny-warm") -> TrainModel:
    """The trainer's model and logprob forward over `model`, as build_train_model sets them for one rank without
    FSDP."""
    model_dir = resolve_model_path(model)
    module, _ = qwen3.build_model(model_dir, device)  # fp32 master weights
    module._skip_lm_head = True  # the fused head, as the Trainer sets it
    hf = qwen3.read_hf_config(model_dir)
    return TrainModel(
        cfg=TrainerConfig(model=str(model_dir), dtype=dtype, share_prompts=share_prompts),
        module=module,
        adapter=None,
        parallel_dims=None,
        device=torch.device(device),
        model_dir=model_dir,
        hf_config=hf,
        max_seq_len=hf["max_position_embeddings"],
        vocab_size=hf["vocab_size"],
        autocast=dtype != "float32",  # no FSDP2 mixed-precision policy on one rank
        fused_lm_head=True,
        head_memory_bytes=2**20,
    )


def vision_language_step(share_prompts: bool) -> TrainModel:
    """The trainer's model and logprob forward over the embedded tiny-vlm (vision tower trainable), as
    build_train_model sets them for one rank without FSDP."""
    from torchtitan.models.qwen3 import Qwen3StateDictAdapter

    from forge_rl.data.vision import load_processor
    from forge_rl.models import vision_language
    from forge_rl.models.sharded_load import load_sharded

    model_dir = resolve_model_path("tiny-vlm")
    hf = qwen3.read_hf_config(model_dir)
    config = vision_language.titan_config(model_dir)
    with torch.device("meta"):
        module = config.build()
        vision_language.attach_vision(module, hf)
    qwen3.materialise(module, torch.device("cpu"))
    load_sharded(
        module, vision_language.VisionLanguageAdapter(Qwen3StateDictAdapter(config, str(model_dir))), model_dir
    )
    module._skip_lm_head = True
    text = vision_language.text_config(hf)
    return TrainModel(
        cfg=TrainerConfig(model=str(model_dir), share_prompts=share_prompts),
        module=module,
        adapter=None,
        parallel_dims=None,
        device=torch.device("cpu"),
        model_dir=model_dir,
        hf_config=text,
        max_seq_len=text["max_position_embeddings"],
        vocab_size=text["vocab_size"],
        autocast=False,
        fused_lm_head=True,
        head_memory_bytes=2**20,
        image_processor=load_processor(model_dir).image_processor,
    )


def group_batch(prompt_len: int = 12, response_len: int = 20) -> tuple[torch.Tensor, torch.Tensor]:
    """Four responses to one prompt: a group, which shared-prompt packing packs into one row."""
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 100, (prompt_len,), generator=g)
    responses = torch.randint(3, 100, (4, response_len), generator=g)
    tokens = torch.cat([prompt.expand(4, prompt_len), responses], dim=1)
    mask = torch.zeros_like(tokens, dtype=torch.bool)
    mask[:, prompt_len:] = True
    return tokens, mask


def bf16_step_dtypes(step: TrainModel, tokens: torch.Tensor, mask: torch.Tensor) -> tuple[list, list]:
    """(norm dtype pairs, matmul dtype pairs) of one forward and backward of `step`, the entropy taking gradient."""
    with NormDtypes() as norms, MatmulDtypes() as matmuls:
        logprobs, entropy = step.logprobs(tokens, "grad", mask)
        (logprobs.sum() + entropy.sum()).backward()
    return norms.seen, matmuls.seen
