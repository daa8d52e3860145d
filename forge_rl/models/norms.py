"""RMSNorm in its input's dtype: the norm weight is cast to the activations' dtype before the norm.

Under bf16 autocast over fp32 master weights, a norm that follows a linear layer (Qwen3's q_norm and k_norm) gets a
bf16 input and an fp32 weight. torch's `rms_norm` then cannot take its fused kernel ("Mismatch dtype between input and
weight") and runs the unfused composite, which promotes its output to fp32, so that everything downstream runs in fp32.
FSDP2's mixed-precision policy casts every parameter, norms included; autocast casts only the inputs of the ops on
its list, and `rms_norm` is not on it. Casting the weight here makes the two agree (a [dim] vector per call): a norm
over the fp32 residual stream stays fp32, one over a bf16 activation runs fused in bf16, as under FSDP2.
"""

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

import forge_rl.deps.torchtitan  # noqa: F401  first: TorchTitan's device type is "cpu" without an accelerator

from torchtitan.models.common import RMSNorm  # noqa: E402


class CastRMSNorm(RMSNorm):
    """TorchTitan's RMSNorm (same parameters, same state-dict names) whose weight meets its input in one dtype."""

    @dataclass(kw_only=True, slots=True)
    class Config(RMSNorm.Config):
        pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if weight is not None and weight.dtype != x.dtype:
            weight = weight.to(x.dtype)
        return F.rms_norm(x, self.normalized_shape, weight, self.eps)


def cast_norm(config: RMSNorm.Config) -> CastRMSNorm.Config:
    """The CastRMSNorm config with every field of `config`."""
    return CastRMSNorm.Config(**{f.name: getattr(config, f.name) for f in fields(config) if f.init})
