"""Keep Routing, the trainer's side: every Qwen3-MoE router uses the experts the engine routed each token to.

A mixture-of-experts layer sends each token to its router's top-k experts. The trainer computes the router's scores
again, and wherever they differ from the engine's by a hair (bf16 kernels, a batch of another shape, weights a
version behind) the top-k may differ: the token's logprob is then computed through other experts than the ones that
sampled it, and the importance ratio measures the routing change, not the policy's. Replaying the engine's choice
(DeepSeek-V3.2's Keep Routing; Rollout Routing Replay) removes that part of the train/inference mismatch.

The model's routers are `ReplayRouter`s (forge_rl/models/replay_router.py); this file sets their routes and reads
their counts without importing TorchTitan, so a process that only spawns the trainer (the controller) does not.

    replay = RouteReplay(model)         # the routers of model.layers[i].moe, in layer order
    replay.set(routes_BTLK)             # before a forward: int16 [B, T, layers, top-k], -1 = no record; None = off
    out = model(tokens)
    replay.stats()                      # since the last stats(): (position, layer) pairs replayed, how many the
                                        # router's own top-k would have routed elsewhere, how many reached the
                                        # expert layer with the recorded experts

The routes stay set until the next `set`, so activation checkpointing's recomputation in the backward replays them
too. Under expert parallelism each rank's router sees its own batch, as here.
"""

import torch

from forge_rl.deps.pytorch import in_backward


class RouteReplay:
    """Sets the routes of every ReplayRouter of `model` before a forward (see the module docstring)."""

    def __init__(self, model: torch.nn.Module):
        self.routers = moe_routers(model)
        if not self.routers:
            raise ValueError(
                "trainer.keep_routing: the model has no mixture-of-experts layer, so there are no "
                "routes to keep; set trainer.keep_routing=false"
            )
        self.shape = (len(self.routers), self.routers[0].top_k, self.routers[0].num_experts)  # what routes must be
        # what each expert layer receives, checked against the record where it is used (not where it is set)
        self.dispatched_equal = [0 for _ in self.routers]
        for layer, router in enumerate(self.routers):
            moe = next(m for m in model.modules() if getattr(m, "router", None) is router)
            moe.routed_experts.register_forward_pre_hook(self._dispatch_check(layer))

    def _dispatch_check(self, layer: int):
        def check(module, args) -> None:
            replay = self.routers[layer].replay_BLK
            if replay is None or not module.training or in_backward():
                return
            ids_BLK = args[2]
            with torch.no_grad():
                recorded = replay[..., 0] >= 0
                same = (ids_BLK.sort(-1).values == replay.to(ids_BLK.device).sort(-1).values).all(-1)
                self.dispatched_equal[layer] = self.dispatched_equal[layer] + (same & recorded).sum()

        return check

    def set(self, routes_BTLK: torch.Tensor | None) -> None:
        """The routes of the next forward's tokens, int16 [B, T, layers, top-k] (-1: none); None: the routers choose."""
        if routes_BTLK is not None and routes_BTLK.shape[2] != len(self.routers):
            raise ValueError(
                f"Keep Routing: routes for {routes_BTLK.shape[2]} MoE layers; the model has {len(self.routers)}"
            )
        for layer, router in enumerate(self.routers):
            router.replay_BLK = None if routes_BTLK is None else routes_BTLK[:, :, layer].long()

    def stats(self) -> torch.Tensor:
        """int64 [3] since the last call, then zeroed: the (position, layer) pairs replayed; of them, those the
        routers' own top-k would have sent to another set of experts (the routing part of the train/inference
        mismatch); and those whose experts, as the expert layer received them, were the recorded ones."""
        counts = [[r.replayed for r in self.routers], [r.differed for r in self.routers], self.dispatched_equal]
        out = torch.tensor([sum(int(c) for c in row) for row in counts], dtype=torch.int64)  # one sync per count
        for router in self.routers:
            router.replayed = router.differed = 0
        self.dispatched_equal = [0 for _ in self.routers]
        return out


def moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The ReplayRouters of `model`'s decoder layers (routers that take routes: `replay_BLK`), in layer order."""
    layers = getattr(model, "layers", {})
    routers = [
        getattr(getattr(layer, "moe", None), "router", None)
        for _, layer in sorted(layers.items(), key=lambda item: int(item[0]))
    ]
    return [r for r in routers if hasattr(r, "replay_BLK")]


def packed_routes(routes_BTLK: torch.Tensor, source_NL: torch.Tensor) -> torch.Tensor:
    """The routes of prompt-packed rows (forge_rl/data/prompt_packing.py: `source`, the unpacked place of each packed
    token, -1 for padding), -1 where a packed place has none."""
    flat = routes_BTLK.flatten(0, 1)[source_NL.clamp(min=0)]
    return flat.masked_fill((source_NL < 0)[..., None, None], -1)
