"""The policy's gradients of one training step: forward, logprobs, loss and backward over a rank's micro-batches.
Trainer.step (forge_rl/actors/trainer.py) calls it, then clips and steps the optimizer.

The metrics' sums stay on the device until the step ends, so a step syncs with the host once, not once per metric
per micro-batch.
"""

import torch

from forge_rl.actors.train_model import TrainModel
from forge_rl.losses.grpo import per_token_loss, reduce_loss, sft_token_loss
from forge_rl.types import TrainBatch

# the step's per-token means: the metric's name and the per_token_loss diagnostic it averages
TOKEN_SUMS = (
    "clip_fraction",
    "approx_kl",
    "entropy",
    "ratio_mean",
    "kl_ref",
    "reverse_kl_teacher",
    "mismatch_abs_mean",
    "mismatch_k3",
    "is_weight_mean",
    "is_corrected_fraction",
)
DIAGNOSTIC = {
    "clip_fraction": "clipped",
    "approx_kl": "approx_kl_behaviour",
    "ratio_mean": "ratio",
    "mismatch_abs_mean": "mismatch_abs",
    "is_weight_mean": "is_weight",
    "is_corrected_fraction": "is_corrected",
}


def accumulate_gradients(model: TrainModel, batches: list[TrainBatch]) -> tuple[torch.Tensor, float]:
    """Forward and backward over this rank's batch in micro-batches. Returns this rank's sums of the loss,
    the model tokens and each of TOKEN_SUMS over response tokens, and the largest |log pi - log mu|."""
    cfg, loss_cfg = model.cfg, model.cfg.loss
    batch = batches[model.dp_rank]
    total_seqs = sum(b.num_sequences for b in batches)
    total_tokens = sum(b.num_response_tokens for b in batches)
    normalize = "token_mean" if cfg.objective == "sft" else loss_cfg.normalize
    mb = cfg.micro_batch_size or batch.num_sequences
    # the sums stay on the device until the step ends: one host sync per step, not one per metric per micro-batch
    # (+ Keep Routing's three counts: forge_rl/models/route_replay.py, RouteReplay.stats)
    sums = torch.zeros(2 + len(TOKEN_SUMS) + 3, dtype=torch.float64, device=model.device)
    mismatch_max = torch.zeros((), dtype=torch.float64, device=model.device)
    model.module.train()
    for lo in range(0, batch.num_sequences, mb):
        rows = slice(lo, lo + mb)
        mask = batch.response_mask[rows].to(model.device)
        # the entropy is logged (detached), and takes gradient only when an entropy bonus uses it
        logprobs, entropy = model.logprobs(
            batch.tokens[rows],
            "grad" if loss_cfg.entropy_coef else "detached",
            batch.response_mask[rows],
            batch.kept[rows] if batch.kept is not None else None,
            batch.routes[rows] if batch.routes is not None else None,
            batch.images[rows] if batch.images is not None else None,
        )
        if cfg.objective == "sft":
            token_loss, diag = sft_token_loss(logprobs), {"entropy": entropy.detach()}
        else:
            ref = batch.ref_logprobs[rows].to(model.device) if batch.ref_logprobs is not None else None
            token_loss, diag = per_token_loss(
                logprobs,
                batch.behaviour_logprobs[rows].to(model.device),
                batch.advantages[rows].to(model.device),
                loss_cfg,
                ref_logprobs=ref,
                entropy=entropy,
                mask=mask,
            )
        loss = reduce_loss(token_loss, mask, normalize, total_seqs, total_tokens, loss_cfg.max_response_len)
        if model.router_stats is not None:  # this micro-batch's share of the batch's load-balancing loss
            aux = model.router_stats.pop_loss(model.last_forward_unpadded)
            loss = loss + cfg.moe_aux_loss_coef * aux * (mask.shape[0] / total_seqs)
        loss.backward()
        sums[0] += loss.detach()
        sums[1] += model.last_forward_tokens
        for i, name in enumerate(TOKEN_SUMS, start=2):
            if (key := DIAGNOSTIC.get(name, name)) in diag:
                sums[i] += (diag[key].detach() * mask).sum()
        if model.route_replay is not None:
            sums[-3:] += model.route_replay.stats().to(sums)
        if "mismatch_abs" in diag:
            mismatch_max = torch.maximum(mismatch_max, diag["mismatch_abs"].detach().where(mask, 0.0).max())
    return sums, float(mismatch_max)
