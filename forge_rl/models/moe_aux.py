"""The load-balancing loss of a mixture-of-experts model (`trainer.moe_aux_loss_coef`): HF Qwen3-MoE's
`router_aux_loss_coef` term (transformers' `load_balancing_loss_func`), so that HF's coefficient means the same here:

    aux = E * sum_e f_e * P_e

with E experts, pooled over the forward's MoE layers and its tokens (padding excluded): f_e the number of (token,
layer) top-k choices that went to expert e over the number of (token, layer) pairs (no gradient), and P_e the mean
router probability of expert e over the same pairs. The f_e sum to K (top-k) and the P_e to 1, so aux is K for
perfectly even routing, whatever the number of layers, and grows as routing concentrates (at most E); its gradient
pushes probability away from the overloaded experts. Computed over each forward's tokens on each rank: with data
parallelism a rank balances its own batch, as HF's term balances its own forward's.

    stats = RouterStats(model)      # forward hooks on every TorchTitan MoE router
    out = model(tokens)
    aux = stats.pop_loss(unpadded(response_mask))   # this forward's term (a differentiable scalar), records cleared
    # (prompt-packed rows: unpadded_packed(packed.attention_mask))
"""

import torch

from forge_rl.deps.pytorch import in_backward


class RouterStats:
    """Forward hooks on every MoE router of `model` (TorchTitan's TokenChoiceTopKRouter): each forward's router
    probabilities [B, L, E] and top-k expert ids [B, L, K], kept until `pop_loss`."""

    def __init__(self, model: torch.nn.Module):
        from torchtitan.models.common.moe import TokenChoiceTopKRouter

        self.records: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.handles = [
            m.register_forward_hook(self._record) for m in model.modules() if isinstance(m, TokenChoiceTopKRouter)
        ]
        # each forward of the model starts a new record, so that a caller that never pops (PPO's critic, which
        # shares the trainer's config) holds one forward's router scores at most, not every step's
        self.handles.append(model.register_forward_pre_hook(self._new_forward))

    def _new_forward(self, module, inputs) -> None:
        if not in_backward():  # a checkpointed model's forward run again by its backward: the same forward
            self.records.clear()

    def _record(self, module, inputs, outputs) -> None:
        if not module.training:  # the logprobs of an evaluation or a reference: no loss to add
            return
        if in_backward():  # activation checkpointing recomputing the layer: its forward was recorded already
            return
        _, topk_ids, scores = outputs
        self.records.append((_local(scores), _local(topk_ids)))

    def pop_loss(self, token_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The load-balancing term of the model's last forward (0 without MoE layers); clears the records.
        `token_mask` [B, L]: the forward's tokens that count (False: padding), as HF's attention_mask; None: all."""
        records, self.records = self.records, []
        if not records:
            return torch.zeros(())
        return balancing_loss(records, token_mask)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def balancing_loss(
    layers: list[tuple[torch.Tensor, torch.Tensor]], token_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """E * sum_e f_e * P_e pooled over `layers`, each a (router probabilities [B, L, E], top-k ids [B, L, K]) of one
    forward, over the tokens of `token_mask` [B, L] (see the module docstring)."""
    n_experts = layers[0][0].shape[-1]
    device = layers[0][0].device
    counts = torch.zeros(n_experts, device=device)
    prob_sums = torch.zeros(n_experts, device=device)
    weight = None if token_mask is None else token_mask.reshape(-1).to(device=device, dtype=torch.float32)
    for scores_BLE, ids_BLK in layers:
        scores = scores_BLE.reshape(-1, n_experts).float()
        top_k = ids_BLK.shape[-1]
        ones = torch.ones(ids_BLK.numel(), device=device) if weight is None else weight.repeat_interleave(top_k)
        counts = counts.scatter_add(0, ids_BLK.reshape(-1), ones)
        prob_sums = prob_sums + (scores.sum(0) if weight is None else (scores * weight[:, None]).sum(0))
    pairs = len(layers) * (scores.shape[0] if weight is None else weight.sum().clamp(min=1.0))
    return n_experts * ((counts / pairs).detach() * (prob_sums / pairs)).sum()


def unpadded(response_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] True up to each row's last response token: a right-padded TrainBatch's tokens that are not padding."""
    T = response_mask.shape[-1]
    last = T - 1 - response_mask.flip(-1).int().argmax(-1)
    return torch.arange(T, device=response_mask.device) <= last[..., None]


def unpadded_packed(attention_mask: torch.Tensor) -> torch.Tensor:
    """[N, L] True for the tokens of prompt-packed rows (forge_rl/data/prompt_packing.py) that are not padding, from
    their attention mask [N, 1, L, L]: every packed token sees its row's first token (the shared prompt's), a
    padding token only itself."""
    return attention_mask[:, 0, :, 0]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
