"""The router of Keep Routing (forge_rl/models/route_replay.py): TorchTitan's token-choice router computing its
scores as usual; where a token has recorded experts, those are its top-k, weighted by the current router's scores
over them (renormalised as the model's route_norm says), so the router's gradient and the load-balancing loss stay
defined. Tokens without a record (padding, each row's last token) route as usual."""

from dataclasses import dataclass

import torch

import forge_rl.deps.torchtitan  # noqa: F401  (TorchTitan's device choice fixed before its modules import)
from forge_rl.deps.pytorch import in_backward
from torchtitan.models.common.moe import TokenChoiceTopKRouter  # noqa: E402


class ReplayRouter(TokenChoiceTopKRouter):
    """TorchTitan's token-choice router; `replay_BLK` (int64 [B, L, K], -1 = none), when set, overrides the top-k."""

    @dataclass(kw_only=True, slots=True)
    class Config(TokenChoiceTopKRouter.Config):
        pass

    def __init__(self, config: Config):
        super().__init__(config)
        self.replay_BLK: torch.Tensor | None = None
        # counts on the device (no host sync per forward), since RouteReplay.stats: (position, layer) pairs replayed,
        # and of those, where the router's own top-k set differed. Plain attributes: the model is built on "meta"
        self.replayed = self.differed = 0

    def forward(self, x_BLD: torch.Tensor, expert_bias_E: torch.Tensor | None = None):
        top_scores_BLK, own_ids_BLK, scores_BLE = super().forward(x_BLD, expert_bias_E)
        replay = self.replay_BLK
        if replay is None:
            return top_scores_BLK, own_ids_BLK, scores_BLE
        if replay.shape != own_ids_BLK.shape:
            raise ValueError(
                f"Keep Routing: routes of shape {list(replay.shape)} for a router that chose "
                f"{list(own_ids_BLK.shape)} (batch, tokens, top-k)"
            )
        replay = replay.to(own_ids_BLK.device)
        recorded = replay[..., 0] >= 0
        ids_BLK = torch.where(recorded[..., None], replay, own_ids_BLK)
        # counted in training forwards (a step's), once: activation checkpointing's recomputation is not another
        if self.training and not in_backward():
            with torch.no_grad():
                own = torch.zeros_like(scores_BLE, dtype=torch.bool).scatter_(-1, own_ids_BLK, True)
                used = torch.zeros_like(scores_BLE, dtype=torch.bool).scatter_(-1, ids_BLK, True)
                self.replayed = self.replayed + recorded.sum()
                self.differed = self.differed + ((own != used).any(-1) & recorded).sum()
        top_scores_BLK = scores_BLE.gather(-1, ids_BLK)
        if self.route_norm:
            top_scores_BLK = top_scores_BLK / (top_scores_BLK.sum(dim=-1, keepdim=True) + 1e-20)
        return top_scores_BLK * self.route_scale, ids_BLK, scores_BLE
