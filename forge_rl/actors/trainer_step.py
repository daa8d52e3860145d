"""The trainer's step: forward, logprobs, loss and backward over a rank's micro-batches, then the optimizer step.
A mixin of Trainer (forge_rl/actors/trainer.py), which builds the model, its ranks and the optimizer.

Where the time goes, and what it buys (docs/trainer.md, "Speed"): the lm_head is fused into the logprobs
(forge_rl/losses/fused_head.py) and only the positions that predict a response token go through it; shared prompts
are packed once per group (forge_rl/data/prompt_packing.py); the metrics' sums stay on the device until the step
ends, so a step syncs with the host once, not once per metric per micro-batch.
"""

import math

import torch

from forge_rl.actors.batch_checks import validate_batches
from forge_rl.data.prompt_packing import plan_packing
from forge_rl.losses.fused_head import hidden_logprobs
from forge_rl.losses.grpo import per_token_loss, reduce_loss, sft_token_loss
from forge_rl.losses.logprobs import VocabShard, selected_logprobs, token_logprobs
from forge_rl.models.moe_aux import unpadded, unpadded_packed
from forge_rl.models.route_replay import packed_routes
from forge_rl.types import BatchShape, TrainBatch

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


class TrainerStep:
    def _forward(
        self,
        tokens: torch.Tensor,
        entropy: str = "none",
        response_mask: torch.Tensor | None = None,
        kept: torch.Tensor | None = None,
        routes: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logprob (and entropy) [B, T] of every token, or with `response_mask` of its response tokens
        only (0 elsewhere), computed on shared-prompt packed rows when that saves tokens. `kept` [B, T, K]:
        each token's kept set (truncated sampling: TrainBatch.kept), the distribution renormalised over it.
        `routes` [B, T, layers, top-k]: the engine's experts (TrainBatch.routes), replayed under
        trainer.keep_routing."""
        packed = None
        if response_mask is not None and self.cfg.share_prompts:
            packed = plan_packing(
                tokens, response_mask, self.cfg.pack_max_fraction, self.cfg.pack_max_len, self.attention_pair_cost
            )
        self.last_forward_tokens = tokens.numel() if packed is None else packed.num_tokens
        self.last_forward_unpadded = (
            None
            if response_mask is None
            else unpadded(response_mask)
            if packed is None
            else unpadded_packed(packed.attention_mask)
        )  # the balancing loss's tokens
        d = self.device
        kept = kept.to(d) if kept is not None else None
        if self.route_replay is not None:  # set for every forward: a forward without routes lets the routers choose
            self.route_replay.set(
                None
                if routes is None
                else routes.to(d)
                if packed is None
                else packed_routes(routes, packed.source).to(d)
            )
        if packed is not None:
            out, shard = self._model_out(
                packed.tokens, positions=packed.positions.to(d), attention_masks=packed.attention_mask.to(d)
            )
            pred, targets, where = packed.pred_index, packed.targets, (packed.rows, packed.cols)
        elif response_mask is not None and self.fused_lm_head:
            # only the positions that predict a response token go through the head: a prompt's do not count
            out, shard = self._model_out(tokens)
            where = response_mask.nonzero(as_tuple=True)
            pred, targets = where[0] * tokens.shape[1] + where[1] - 1, tokens[where]
        else:
            return self._every_position(*self._model_out(tokens), tokens, response_mask, entropy, kept)
        return self._at_positions(out, shard, pred, targets, where, tokens.shape, response_mask, entropy, kept)

    def _every_position(
        self,
        out: torch.Tensor,
        shard,
        tokens: torch.Tensor,
        response_mask: torch.Tensor | None,
        entropy: str,
        kept: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logprob (and entropy) of every token of `tokens` from the model's output at every position; with
        `response_mask`, 0 outside the responses."""
        temperature, d = self.cfg.temperature or 1.0, self.device
        if self.fused_lm_head:
            lp, ent = hidden_logprobs(
                out,
                self._lm_head_weight(),
                tokens.to(d),
                temperature,
                entropy,
                memory_bytes=self.head_memory_bytes,
                kept=kept,
                compute_dtype=self.compute_dtype,
            )
        else:
            lp, ent = token_logprobs(out, tokens.to(d), temperature, entropy=entropy, shard=shard, kept=kept)
        if response_mask is None:
            return lp, ent
        keep = response_mask.to(d)  # same result either way: 0 outside the responses
        return lp.where(keep, 0.0), (ent.where(keep, 0.0) if ent is not None else None)

    def _at_positions(
        self,
        out: torch.Tensor,
        shard,
        pred: torch.Tensor,
        targets: torch.Tensor,
        where: tuple,
        shape: torch.Size,
        response_mask: torch.Tensor,
        entropy: str,
        kept: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logprob (and entropy) of `targets` from the model's output at positions `pred` only, put back at
        `where` in a [B, T] of `shape` (0 elsewhere, and outside the responses)."""
        temperature, d = self.cfg.temperature or 1.0, self.device
        picked, targets = out.flatten(0, 1)[pred.to(d)], targets.to(d)
        where = (where[0].to(d), where[1].to(d))  # each target's place in the batch's tokens
        kept = kept[where] if kept is not None else None
        if self.fused_lm_head:
            lp, ent = hidden_logprobs(
                picked[None],
                self._lm_head_weight(),
                targets[None],
                temperature,
                entropy,
                shift=0,
                memory_bytes=self.head_memory_bytes,
                kept=kept[None] if kept is not None else None,
                compute_dtype=self.compute_dtype,
            )
            lp, ent = lp[0], (ent[0] if ent is not None else None)
        else:
            lp, ent = selected_logprobs(picked, targets, temperature, entropy=entropy, shard=shard, kept=kept)
        zeros = torch.zeros(shape, dtype=lp.dtype, device=d)
        keep = response_mask.to(d)  # packed spans hold an environment's tokens too (multi-turn): 0 for them
        return (
            zeros.index_put(where, lp).where(keep, 0.0),
            zeros.index_put(where, ent).where(keep, 0.0) if ent is not None else None,
        )

    @property
    def compute_dtype(self) -> torch.dtype:
        """The forward's matmul dtype (trainer.dtype) over fp32 master weights. FSDP2's mixed-precision policy hands
        the decoder cast parameters; autocast (no FSDP) casts only its ops' inputs and leaves the residual stream, and
        so the final hidden states, in fp32: the fused head casts them back to this dtype."""
        return getattr(torch, self.cfg.dtype)

    def _lm_head_weight(self) -> torch.Tensor:
        """The lm_head's whole weight, as the decoder's forward left it (FSDP2: unsharded until backward)."""
        from torch.distributed.tensor import DTensor

        weight = self.model.lm_head.weight
        if isinstance(weight, DTensor):
            raise RuntimeError(
                "trainer.fused_lm_head: the lm_head weight is still sharded after the forward "
                "(an FSDP reshard-after-forward policy?); set trainer.fused_lm_head=false"
            )
        return weight

    def _model_out(self, tokens: torch.Tensor, **kwargs) -> tuple[torch.Tensor, VocabShard | None]:
        """The logits, or the final hidden states when the lm_head is fused into the logprobs. Under TP the
        logits are this rank's vocabulary shard, with the VocabShard that says which (loss parallel: the
        logprobs are reduced over ranks without gathering the logits)."""
        from torch.distributed.tensor import DTensor, Shard

        with torch.autocast(self.device.type, dtype=self.compute_dtype, enabled=self.autocast):
            out = self.model(tokens.to(self.device), **kwargs)
        if not isinstance(out, DTensor):
            return out, None
        if out.placements == (Shard(out.ndim - 1),):
            self.loss_parallel = True
            return out.to_local(), VocabShard.of(out.device_mesh.get_group(), out.shape[-1])
        return out.full_tensor(), None

    def _validate_everywhere(self, batches: list[TrainBatch | BatchShape]) -> None:
        """Each rank checks its batches, then all agree (one small all-reduce) before the step's first collective:
        when one rank's batch is malformed, every rank raises, none waits in an all-gather, nothing changes."""
        import torch.distributed as dist

        error = None
        try:
            validate_batches(
                batches,
                self.dp_size,
                self.vocab_size,
                self.max_seq_len,
                own=self.dp_rank,
                routing=self.route_replay.shape if self.route_replay is not None else None,
            )
        except ValueError as e:
            error = e
        ok = torch.tensor([0.0 if error else 1.0], device=self.device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if error is not None:
            raise error
        if ok.item() == 0:
            raise ValueError("another trainer rank rejected its batch (its error names the field); nothing changed")

    def _accumulate_gradients(self, batches: list[TrainBatch]) -> tuple[torch.Tensor, float]:
        """Forward and backward over this rank's batch in micro-batches. Returns this rank's sums of the loss,
        the model tokens and each of TOKEN_SUMS over response tokens, and the largest |log pi - log mu|."""
        cfg, loss_cfg = self.cfg, self.cfg.loss
        batch = batches[self.dp_rank]
        total_seqs = sum(b.num_sequences for b in batches)
        total_tokens = sum(b.num_response_tokens for b in batches)
        normalize = "token_mean" if cfg.objective == "sft" else loss_cfg.normalize
        mb = cfg.micro_batch_size or batch.num_sequences
        # the sums stay on the device until the step ends: one host sync per step, not one per metric per micro-batch
        # (+ Keep Routing's three counts: forge_rl/models/route_replay.py, RouteReplay.stats)
        sums = torch.zeros(2 + len(TOKEN_SUMS) + 3, dtype=torch.float64, device=self.device)
        mismatch_max = torch.zeros((), dtype=torch.float64, device=self.device)
        self.model.train()
        for lo in range(0, batch.num_sequences, mb):
            rows = slice(lo, lo + mb)
            mask = batch.response_mask[rows].to(self.device)
            # the entropy is logged (detached), and takes gradient only when an entropy bonus uses it
            logprobs, entropy = self._forward(
                batch.tokens[rows],
                "grad" if loss_cfg.entropy_coef else "detached",
                batch.response_mask[rows],
                batch.kept[rows] if batch.kept is not None else None,
                batch.routes[rows] if batch.routes is not None else None,
            )
            if cfg.objective == "sft":
                token_loss, diag = sft_token_loss(logprobs), {"entropy": entropy.detach()}
            else:
                ref = batch.ref_logprobs[rows].to(self.device) if batch.ref_logprobs is not None else None
                token_loss, diag = per_token_loss(
                    logprobs,
                    batch.behaviour_logprobs[rows].to(self.device),
                    batch.advantages[rows].to(self.device),
                    loss_cfg,
                    ref_logprobs=ref,
                    entropy=entropy,
                    mask=mask,
                )
            loss = reduce_loss(token_loss, mask, normalize, total_seqs, total_tokens, loss_cfg.max_response_len)
            if self.router_stats is not None:  # this micro-batch's share of the batch's load-balancing loss
                aux = self.router_stats.pop_loss(self.last_forward_unpadded)
                loss = loss + cfg.moe_aux_loss_coef * aux * (mask.shape[0] / total_seqs)
            loss.backward()
            sums[0] += loss.detach()
            sums[1] += self.last_forward_tokens
            for i, name in enumerate(TOKEN_SUMS, start=2):
                if (key := DIAGNOSTIC.get(name, name)) in diag:
                    sums[i] += (diag[key].detach() * mask).sum()
            if self.route_replay is not None:
                sums[-3:] += self.route_replay.stats().to(sums)
            if "mismatch_abs" in diag:
                mismatch_max = torch.maximum(mismatch_max, diag["mismatch_abs"].detach().where(mask, 0.0).max())
        return sums, float(mismatch_max)

    def _apply_gradients(self, loss: float) -> tuple[float, bool]:
        """Clip, then `optimizer.step()` unless the gradient norm is not finite (as Trainer.step does, for the roles
        built on the trainer that step on their own: the critic). Returns (grad norm, finite)."""
        grad_norm = self._clip_grad_norm()
        finite = math.isfinite(grad_norm)
        if finite:
            self.optimizer.step()
            self.scheduler.step()
        self._count_step(finite, loss)
        return grad_norm, finite

    def _count_step(self, finite: bool, loss: float) -> None:
        """After an optimizer step, or a step skipped for a non-finite gradient norm (the weights, optimizer state
        and schedule then stayed as they were): the gradients cleared, the version counted, and too many skipped
        steps in a row stop the run."""
        if finite:
            self.nonfinite_in_a_row = 0
        else:
            self.skipped_steps += 1
            self.nonfinite_in_a_row += 1
        self.optimizer.zero_grad(set_to_none=True)
        self.steps_taken += 1  # the policy version advances either way, so versions stay in step with the run
        if self.nonfinite_in_a_row >= self.cfg.max_nonfinite_steps:
            raise FloatingPointError(
                f"{self.nonfinite_in_a_row} train steps in a row had a non-finite gradient norm (loss {loss}); "
                f"stopping (trainer.max_nonfinite_steps={self.cfg.max_nonfinite_steps}). Check rewards, behaviour "
                "logprobs and the learning rate"
            )

    def _reduce_over_data_parallel(self, sums: torch.Tensor, largest: float) -> tuple[torch.Tensor, float]:
        """Sum the per-rank sums over ranks (ranks of one TP group hold the same rows, so each counts 1/tp) and
        take the largest of `largest`. The collectives run on the process group's device (NCCL has no CPU
        tensors)."""
        import torch.distributed as dist

        sums = (sums / (self.world // self.dp_size)).to(self.device)
        dist.all_reduce(sums)
        peak = torch.tensor([largest], dtype=torch.float64, device=self.device)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        return sums.cpu(), float(peak)

    def _clip_grad_norm(self) -> float:
        from torch.distributed.tensor import DTensor

        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.cfg.optim.max_grad_norm or float("inf")
        if self.parallel_dims.ep_enabled:  # experts' gradients live on the EP mesh, the others on the FSDP mesh
            from torchtitan.distributed.utils import clip_grad_norm_

            norm = clip_grad_norm_(params, max_norm, foreach=True, ep_enabled=True)
        else:
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        return float(norm)
