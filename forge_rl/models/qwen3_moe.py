"""Qwen3-MoE in TorchTitan, built from a Hugging Face `Qwen3MoeForCausalLM` directory.

TorchTitan 0.3.0's Qwen3-MoE layers (`_build_qwen3_moe_layers`, through forge_rl/deps/torchtitan.py) with three
changes so that the trainer computes what the checkpoint and vLLM compute:

- the router has no auxiliary-loss-free bias (`load_balance_coeff=None`): TorchTitan's bias moves the top-k choice
  with a buffer that no HF checkpoint and no inference engine has, so trained and served routing would differ.
  The load-balancing loss is the trainer's option instead (`trainer.moe_aux_loss_coef`, forge_rl/models/moe_aux.py);
- the experts compute in the activations' dtype (`ExactExperts`): TorchTitan's grouped experts always cast to
  bfloat16 for `torch._grouped_mm`, so an fp32 trainer would not match an fp32 engine; the grouped GEMM is kept
  for bfloat16 on CUDA, a loop over the local experts otherwise;
- every layer is sparse (`decoder_sparse_step=1`, no `mlp_only_layers`), no shared experts: Qwen3-MoE's layout;
- the router can replay the engine's experts (`ReplayRouter`, forge_rl/models/replay_router.py: Keep Routing); it
  routes as TorchTitan's does until given routes.

The experts of one layer are one parameter each (w1/w3 [E, F, D], w2 [E, D, F]); the checkpoint has one tensor
per expert (`model.layers.{L}.mlp.experts.{e}.gate_proj.weight` ...): `expert_names` maps one onto the other,
which sharded loading and publishing use per expert, a rank touching only the experts (and rows) it holds.
"""

import dataclasses
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from forge_rl.deps.torchtitan import build_qwen3_moe_layers
from forge_rl.models.qwen3_config import attention_shape, model_config, read_hf_config
from forge_rl.models.replay_router import ReplayRouter

from torchtitan.models.common.moe import GroupedExperts  # noqa: E402

# TorchTitan's router asks for an fp32 CPU autocast, which CPU autocast does not have: the gate then runs in the
# input's dtype (fp32 masters on CPU), and torch warns on every forward.
warnings.filterwarnings("ignore", message="In CPU autocast, but the target dtype is not supported")

# TorchTitan's grouped expert parameter -> the HF per-expert projection it stacks
EXPERT_PARTS = {"w1_EFD": "gate_proj", "w3_EFD": "up_proj", "w2_EDF": "down_proj"}
_EXPERT_PARAM = re.compile(r"^layers\.(\d+)\.moe\.routed_experts\.inner_experts\.(w1_EFD|w2_EDF|w3_EFD)$")


class ExactExperts(GroupedExperts):
    """TorchTitan's grouped experts computing in the input's dtype (see the module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        pass

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        if x_RD.is_cuda and x_RD.dtype == torch.bfloat16:
            return super().forward(x_RD, num_tokens_per_expert_E)
        w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD))
        out, start = [], 0
        for e, n in enumerate(num_tokens_per_expert_E.tolist()):
            x = x_RD[start : start + int(n)]
            start += int(n)
            h = F.silu(torch.matmul(x, w1[e].transpose(0, 1).to(x.dtype))) * torch.matmul(
                x, w3[e].transpose(0, 1).to(x.dtype)
            )
            out.append(torch.matmul(h, w2[e].transpose(0, 1).to(x.dtype)))
        # in the input's dtype: under CPU autocast (a bf16 trainer on one rank) the matmuls give bf16 for fp32
        # tokens, and the combine adds the experts' outputs into a buffer of the tokens' dtype
        return torch.cat(out).to(x_RD.dtype) if out else x_RD.new_zeros((0, x_RD.shape[-1]))


def titan_config(model_dir: str | Path, hf: dict):
    """TorchTitan's Qwen3 config (MoE layers) for the HF Qwen3-MoE config `hf` of `model_dir`."""
    where = f"{model_dir}/config.json"
    if hf.get("decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers"):
        raise ValueError(
            f"{where}: decoder_sparse_step={hf.get('decoder_sparse_step')} mlp_only_layers="
            f"{hf.get('mlp_only_layers')}; forge_rl's Qwen3-MoE takes every layer sparse (step 1, none "
            "dense), as Qwen3-30B-A3B and 235B-A22B are"
        )
    if not hf.get("norm_topk_prob", False):
        raise ValueError(
            f"{where}: norm_topk_prob is false; forge_rl's Qwen3-MoE renormalises the top-k router "
            "weights (TorchTitan's route_norm), as the released Qwen3-MoE checkpoints do"
        )
    head_dim, rope = attention_shape(hf)
    layers = build_qwen3_moe_layers(
        n_layers=hf["num_hidden_layers"],
        dim=hf["hidden_size"],
        n_heads=hf["num_attention_heads"],
        n_kv_heads=hf["num_key_value_heads"],
        head_dim=head_dim,
        moe_hidden_dim=hf["moe_intermediate_size"],
        num_experts=num_experts(hf),
        top_k=hf["num_experts_per_tok"],
        attn_backend="flex",  # replaced by model_config
        moe_comm_backend="standard",  # all-to-all over the EP group: torch.distributed's, gloo included
        rope=rope,
    )
    for layer in layers:
        layer.moe.load_balance_coeff = None
        inner = layer.moe.routed_experts.inner_experts
        layer.moe.routed_experts.inner_experts = ExactExperts.Config(
            dim=inner.dim, hidden_dim=inner.hidden_dim, num_experts=inner.num_experts, param_init=inner.param_init
        )
        router = layer.moe.router
        layer.moe.router = ReplayRouter.Config(**{f.name: getattr(router, f.name) for f in dataclasses.fields(router)})
    return model_config(hf, layers)


def num_experts(hf: dict) -> int:
    return hf.get("num_experts") or hf["num_local_experts"]


def is_moe(model_dir: str | Path) -> bool:
    return read_hf_config(model_dir).get("model_type") == "qwen3_moe"


def expert_param(name: str) -> tuple[int, str] | None:
    """(layer, HF projection) of a grouped expert parameter's state-dict name, or None for any other name."""
    m = _EXPERT_PARAM.match(name)
    return (int(m.group(1)), EXPERT_PARTS[m.group(2)]) if m else None


def expert_names(name: str, n_experts: int) -> list[str]:
    """The checkpoint's per-expert tensors stacked in grouped expert parameter `name`, in expert order."""
    layer, part = expert_param(name)
    return [f"model.layers.{layer}.mlp.experts.{e}.{part}.weight" for e in range(n_experts)]
