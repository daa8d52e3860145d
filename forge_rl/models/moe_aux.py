"""The load-balancing loss of a mixture-of-experts model (`trainer.moe_aux_loss_coef`), the Switch Transformer's
and HF Qwen3-MoE's `router_aux_loss_coef` term:

    aux = sum over MoE layers of  E * sum_e f_e * P_e

with E experts, f_e the fraction of the layer's (token, top-k slot) choices that went to expert e (no gradient) and
P_e the mean router probability of expert e over the tokens. It is E x (1/E^2) x E = 1 for perfectly even routing
and grows as routing concentrates; its gradient pushes probability away from the overloaded experts. Computed over
each forward's tokens on each rank (padding included): with data parallelism a rank balances its own batch.

    stats = RouterStats(model)      # forward hooks on every TorchTitan MoE router
    out = model(tokens)
    aux = stats.pop_loss()           # this forward's term (a differentiable scalar), records cleared
"""

import torch

from forge_rl.deps.pytorch import in_backward


class RouterStats:
    """Forward hooks on every MoE router of `model` (TorchTitan's TokenChoiceTopKRouter): each forward's router
    probabilities [B, L, E] and top-k expert ids [B, L, K], kept until `pop_loss`."""

    def __init__(self, model: torch.nn.Module):
        from torchtitan.models.common.moe import TokenChoiceTopKRouter

        self.records: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.handles = [m.register_forward_hook(self._record) for m in model.modules()
                        if isinstance(m, TokenChoiceTopKRouter)]

    def _record(self, module, inputs, outputs) -> None:
        if not module.training:  # the logprobs of an evaluation or a reference: no loss to add
            return
        if in_backward():  # activation checkpointing recomputing the layer: its forward was recorded already
            return
        _, topk_ids, scores = outputs
        self.records.append((_local(scores), _local(topk_ids)))

    def pop_loss(self) -> torch.Tensor:
        """The load-balancing term of the forwards since the last call (0 without MoE layers); clears them."""
        records, self.records = self.records, []
        if not records:
            return torch.zeros(())
        return sum(balancing_loss(scores, ids) for scores, ids in records)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def balancing_loss(scores_BLE: torch.Tensor, topk_ids_BLK: torch.Tensor) -> torch.Tensor:
    """E * sum_e f_e * P_e of one layer (see the module docstring)."""
    n_experts = scores_BLE.shape[-1]
    scores = scores_BLE.reshape(-1, n_experts).float()
    counts = torch.zeros(n_experts, device=scores.device).scatter_add_(
        0, topk_ids_BLK.reshape(-1), torch.ones(topk_ids_BLK.numel(), device=scores.device))
    f = counts / topk_ids_BLK.numel()
    return n_experts * (f.detach() * scores.mean(0)).sum()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
