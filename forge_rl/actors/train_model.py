"""The model a trainer-built role holds: TorchTitan's Qwen3 on this actor's ranks, with what the roles compute from it.

    model = build_train_model(cfg)                                 # forge_rl/actors/train_model_build.py
    logprobs, entropy = model.logprobs(tokens, "detached", response_mask, kept, routes)

The Trainer, the Critic, the Reference and the Tinker trainer each hold one (composition): the parallelised module
and the facts about it (ranks, shapes, the fused head's budget), the logprob forward over it, and the collectives
every step needs (the batch check all ranks agree on, the metrics' sums over data-parallel ranks, the global gradient
norm).

Where the forward's time goes, and what it buys (docs/trainer.md, "Speed"): the lm_head is fused into the logprobs
(forge_rl/losses/fused_head.py) and only the positions that predict a response token go through it; shared prompts
are packed once per group (forge_rl/data/prompt_packing.py).
"""

from dataclasses import dataclass, field
from pathlib import Path

import torch

from forge_rl.actors.batch_checks import validate_batches
from forge_rl.actors.trainer_config import TrainerConfig
from forge_rl.data.prompt_packing import before_responses, plan_packing
from forge_rl.losses.fused_head import hidden_logprobs
from forge_rl.losses.logprobs import VocabShard, selected_logprobs, token_logprobs
from forge_rl.models.moe_aux import RouterStats, unpadded, unpadded_packed
from forge_rl.models.route_replay import RouteReplay, packed_routes
from forge_rl.types import BatchShape, TrainBatch


@dataclass
class TrainModel:
    cfg: TrainerConfig
    module: torch.nn.Module  # TorchTitan's model: parallelised, materialised, loaded
    adapter: object  # TorchTitan's state-dict adapter: its names <-> the checkpoint's (HF) names
    parallel_dims: object  # TorchTitan's ParallelDims (None on one rank without a mesh)
    device: torch.device
    model_dir: Path
    hf_config: dict
    max_seq_len: int
    vocab_size: int
    autocast: bool  # no FSDP mixed-precision policy (one data-parallel shard): autocast gives the compute dtype
    fused_lm_head: bool  # the decoder returns hidden states; the lm_head runs inside the logprobs
    head_memory_bytes: int  # the fused head's working memory
    rank: int = 0
    world: int = 1
    dp_rank: int = 0  # this rank's data-parallel shard: the batch it trains on (ranks of one TP group share it)
    dp_size: int = 1
    checkpoint_read: dict = field(default_factory=dict)  # what this rank read of the checkpoint at start
    router_stats: RouterStats | None = None  # MoE: the load-balancing loss (trainer.moe_aux_loss_coef)
    route_replay: RouteReplay | None = None  # MoE: the engine's experts replayed (trainer.keep_routing)
    loss_parallel: bool = False  # set once the model hands back vocabulary-sharded logits (TP)
    last_forward_tokens: int = 0  # what the last forward ran on (fewer than the batch's when prompts were packed)
    last_forward_unpadded: torch.Tensor | None = None  # its tokens for the balancing loss
    image_processor: object = None  # a vision-language model's (transformers'): a batch's images -> its pixels

    def __post_init__(self):
        from forge_rl.models.qwen3_config import attention_pair_cost  # TorchTitan's: imported in the role's process

        hf = self.hf_config
        self.tied = bool(hf.get("tie_word_embeddings", False))
        self.head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
        self.heads_per_kv = hf["num_attention_heads"] // hf["num_key_value_heads"]
        self.attention_pair_cost = attention_pair_cost(hf)  # weighs shared-prompt packing

    def logprobs(
        self,
        tokens: torch.Tensor,
        entropy: str = "none",
        response_mask: torch.Tensor | None = None,
        kept: torch.Tensor | None = None,
        routes: torch.Tensor | None = None,
        images: list[tuple[bytes, ...]] | None = None,
        sampled: torch.Tensor | None = None,
        prompt_targets: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logprob (and entropy) [B, T] of every token, or with `response_mask` of its response tokens
        only (0 elsewhere), computed on shared-prompt packed rows when that saves tokens. `kept` [B, T, K]:
        each token's kept set (truncated sampling: TrainBatch.kept), the distribution renormalised over it.
        `routes` [B, T, layers, top-k]: the engine's experts (TrainBatch.routes), replayed under
        trainer.keep_routing. `images`: each row's (TrainBatch.images), which a vision-language model's image
        tokens stand for; a group's rows are packed only with rows of the same images.
        `sampled`: the model's own tokens, where an image token's id is text (default: `response_mask`).
        `prompt_targets`: each row's tokens before its response (after its first) are targets too; packed, a
        group's are computed in its first row only, 0 in the others."""
        shown = self.vision_inputs(tokens, images, sampled if sampled is not None else response_mask)
        packed = None
        if response_mask is not None and self.cfg.share_prompts:
            packed = plan_packing(
                tokens,
                response_mask,
                self.cfg.pack_max_fraction,
                self.cfg.pack_max_len,
                self.attention_pair_cost,
                row_keys=images if shown else None,  # rows of other images never share a prompt
                prompt_targets=prompt_targets,
            )
        if prompt_targets:
            response_mask = response_mask | before_responses(response_mask)
        if shown:
            image_batch, feature_at = shown
            if packed is not None:  # each packed place takes its unpacked source's feature
                feature_at = feature_at.flatten()[packed.source.clamp(min=0)].masked_fill(packed.source < 0, -1)
            self.module.vision.show(image_batch, feature_at)
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
            out, shard = self._output(
                packed.tokens, positions=packed.positions.to(d), attention_masks=packed.attention_mask.to(d)
            )
            pred, targets, where = packed.pred_index, packed.targets, (packed.rows, packed.cols)
        elif response_mask is not None and self.fused_lm_head:
            # only the positions that predict a response token go through the head: a prompt's do not count
            out, shard = self._output(tokens)
            where = response_mask.nonzero(as_tuple=True)
            pred, targets = where[0] * tokens.shape[1] + where[1] - 1, tokens[where]
        else:
            return self._every_position(*self._output(tokens), tokens, response_mask, entropy, kept)
        return self._at_positions(out, shard, pred, targets, where, tokens.shape, response_mask, entropy, kept)

    def vision_inputs(
        self, tokens: torch.Tensor, images: list[tuple[bytes, ...]] | None, sampled: torch.Tensor | None
    ) -> tuple | None:
        """A vision-language model's next forward's images, every row's in order, and the map of their features onto
        `tokens` (vision_language.feature_map); None: a text model or a text batch. `sampled`: the tokens the model
        sampled, whose image-token ids are text."""
        from forge_rl.models.vision_language import feature_map, image_pixels

        if self.image_processor is None:
            if images and any(images):
                raise ValueError(f"the batch has images and {self.model_dir} is a text-only model")
            return None
        image_batch = image_pixels(self.image_processor, images or [])
        feature_at = feature_map(tokens, image_batch, self.module.vision, sampled)  # raises on a count mismatch
        self.module.vision.show(None)
        return None if image_batch is None else (image_batch, feature_at)

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
                self.lm_head_weight(),
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
                self.lm_head_weight(),
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

    def lm_head_weight(self) -> torch.Tensor:
        """The lm_head's whole weight, as the decoder's forward left it (FSDP2: unsharded until backward)."""
        from torch.distributed.tensor import DTensor

        weight = self.module.lm_head.weight
        if isinstance(weight, DTensor):
            raise RuntimeError(
                "trainer.fused_lm_head: the lm_head weight is still sharded after the forward "
                "(an FSDP reshard-after-forward policy?); set trainer.fused_lm_head=false"
            )
        return weight

    def _output(self, tokens: torch.Tensor, **kwargs) -> tuple[torch.Tensor, VocabShard | None]:
        """The logits, or the final hidden states when the lm_head is fused into the logprobs. Under TP the
        logits are this rank's vocabulary shard, with the VocabShard that says which (loss parallel: the
        logprobs are reduced over ranks without gathering the logits)."""
        from torch.distributed.tensor import DTensor, Shard

        with torch.autocast(self.device.type, dtype=self.compute_dtype, enabled=self.autocast):
            out = self.module(tokens.to(self.device), **kwargs)
        if not isinstance(out, DTensor):
            return out, None
        if out.placements == (Shard(out.ndim - 1),):
            self.loss_parallel = True
            return out.to_local(), VocabShard.of(out.device_mesh.get_group(), out.shape[-1])
        return out.full_tensor(), None

    def validate_everywhere(self, batches: list[TrainBatch | BatchShape]) -> None:
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

    def reduce_over_data_parallel(self, sums: torch.Tensor, largest: float) -> tuple[torch.Tensor, float]:
        """Sum the per-rank sums over ranks (ranks of one TP group hold the same rows, so each counts 1/tp) and
        take the largest of `largest`. The collectives run on the process group's device (NCCL has no CPU
        tensors)."""
        import torch.distributed as dist

        sums = (sums / (self.world // self.dp_size)).to(self.device)
        dist.all_reduce(sums)
        peak = torch.tensor([largest], dtype=torch.float64, device=self.device)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        return sums.cpu(), float(peak)

    def clip_grad_norm(self, max_norm: float) -> float:
        """Clip the gradients to `max_norm` (0: no clipping) by their norm over every rank; returns that norm."""
        from torch.distributed.tensor import DTensor

        params = [p for p in self.module.parameters() if p.grad is not None]
        max_norm = max_norm or float("inf")
        # experts' gradients live on the EP mesh, the others on the FSDP mesh
        if self.parallel_dims is not None and self.parallel_dims.ep_enabled:
            from torchtitan.distributed.utils import clip_grad_norm_

            norm = clip_grad_norm_(params, max_norm, foreach=True, ep_enabled=True)
        else:
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        return float(norm)
