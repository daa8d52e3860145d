"""Critic: PPO's value model, a TorchTitan Qwen3 body with a scalar value head, trained beside the policy.

    critic = await Critic.options(procs=2, spmd=True).as_actor(trainer_cfg, value_clip=0.2, epochs=1)
    values = await critic.values.call(batches)       # each rank: its own batch's values [B, T]
    metrics = await critic.step.call(batches)  # batches carrying `values` and `returns` (GAE's targets)

An actor of its own over the trainer's parts (forge_rl/actors/train_model.py and beside it): the policy's model with
its lm_head replaced by a 1-wide linear (no weight tying), built through `build_train_model` with the value head's
config, so the critic has its own FSDP2 x TP ranks, fp32 masters, AdamW, learning-rate schedule and DCP checkpoint,
placed by `resources` like any role. Its weights are never published: generators run the policy.

The body comes from `critic.model` (default: the policy's checkpoint); the value head starts at 0, so the first
values are 0 and the first updates move the head alone. From a reward model's checkpoint (an HF sequence classifier)
the body is its body and the value head its score head, so the first values are the reward model's scores of each
prefix.

V[b, t] is the value of the state just before token t was chosen: the head reads the hidden state at t - 1, as
the policy's logprob of token t does. Values are 0 outside the response mask.
"""

import time
from dataclasses import asdict
from pathlib import Path

import torch
from monarch.actor import endpoint

from forge_rl.actors.train_checkpoint import TrainCheckpoint
from forge_rl.actors.train_model import TrainModel
from forge_rl.actors.train_model_build import build_train_model, checkpoint_config
from forge_rl.actors.train_optimizer import StepCounts, apply_gradients, build_optimizer
from forge_rl.actors.trainer import peak_rss_mb
from forge_rl.actors.trainer_config import TrainerConfig
from forge_rl.losses.grpo import reduce_loss
from forge_rl.losses.ppo import value_loss
from forge_rl.runtime import ForgeActor
from forge_rl.types import BatchShape, TrainBatch

# A Hugging Face sequence classifier (a reward model: Qwen3ForSequenceClassification) has the body's tensors and a
# `score` head instead of an lm_head; that head becomes the value head.
SCORE_HEAD = "score.weight"


def value_head_config(cfg: TrainerConfig, model_dir: Path, parallelism) -> object:
    """The checkpoint's model config with a 1-wide value head as its lm_head, replicated over TP ranks."""
    import spmd_types as spmd
    from torchtitan.models.common import Linear
    from torchtitan.models.common.decoder_sharding import dense_activation_placement, dense_param_placement
    from torchtitan.protocols.sharding import ShardingConfig

    from forge_rl.deps.torchtitan import LINEAR_INIT

    config = checkpoint_config(cfg, model_dir, parallelism)
    config.lm_head = Linear.Config(in_features=config.dim, out_features=1, param_init=LINEAR_INIT)
    if parallelism.tensor_parallel_degree > 1:  # one output column cannot be split over TP ranks: replicate it
        replicated = dense_activation_placement(tp=spmd.R)
        config.lm_head.sharding_config = ShardingConfig(
            state_shardings={"weight": dense_param_placement(tp=spmd.R)},
            in_src_shardings={"input": replicated},
            in_dst_shardings={"input": replicated},
            out_src_shardings=replicated,
            out_dst_shardings=replicated,
        )
    config.enable_weight_tying = False  # the embeddings stay the checkpoint's; the head is the value head
    return config


def value_head_start(cfg: TrainerConfig, model_dir: Path, module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The value head's start: a reward model's score head (one label: its logit; two: label 1's logit minus
    label 0's, which orders completions as p(label 1) does), else 0."""
    from forge_rl.models.sharded_load import SafetensorsCheckpoint

    shape = tuple(module.lm_head.weight.shape)  # (1, hidden)
    checkpoint = SafetensorsCheckpoint(model_dir)
    if SCORE_HEAD not in checkpoint.names:
        return {"lm_head.weight": torch.zeros(shape)}
    score = checkpoint.read(SCORE_HEAD).float()
    if score.dim() != 2 or score.shape[0] not in (1, 2) or score.shape[1] != shape[1]:
        raise ValueError(
            f"critic.model={model_dir}: score.weight has shape {tuple(score.shape)}; a value "
            f"head starts from a reward model with 1 or 2 labels over {shape[1]} hidden units"
        )
    return {"lm_head.weight": score[:1] if score.shape[0] == 1 else score[1:] - score[:1]}


class Critic(ForgeActor):
    model: TrainModel
    checkpoint: TrainCheckpoint

    def __init__(self, cfg: TrainerConfig, value_clip: float = 0.2, epochs: int = 1):
        if value_clip < 0:
            raise ValueError(f"critic.value_clip must be >= 0 (0: no clipping), got {value_clip}")
        if epochs < 1:
            raise ValueError(f"critic.epochs must be >= 1, got {epochs}")
        if cfg.lora.enabled:
            raise ValueError("critic: LoRA is for the policy (trainer.lora); the critic trains its whole model")
        # the value head is a real module: no fused vocabulary head, no prompt packing (values of every position)
        self.cfg = TrainerConfig(**{**vars(cfg), "fused_lm_head": False, "share_prompts": False})
        self.value_clip, self.epochs = value_clip, epochs
        self.counts = StepCounts(self.cfg.max_nonfinite_steps)

    @endpoint
    async def setup(self) -> None:
        self.model = build_train_model(self.cfg, value_head_config, value_head_start, not_loaded=(SCORE_HEAD,))
        self.optimizer, self.scheduler = build_optimizer(self.model, self.cfg.optim)
        self.checkpoint = TrainCheckpoint(self.model, self.optimizer, self.scheduler, self.counts)

    def _values(self, tokens: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
        """V [B, T] (float32, on the device), 0 outside `response_mask`; with gradient when training."""
        from torch.distributed.tensor import DTensor

        d = self.model.device
        with torch.autocast(d.type, dtype=getattr(torch, self.cfg.dtype), enabled=self.model.autocast):
            out = self.model.module(tokens.to(d))
        if isinstance(out, DTensor):  # TP: the 1-wide head's output is gathered (B x T floats)
            out = out.full_tensor()
        head = out[..., 0].float()
        values = torch.cat([torch.zeros_like(head[:, :1]), head[:, :-1]], dim=1)  # token t's state is t - 1's
        return values.where(response_mask.to(d), 0.0)

    @endpoint
    async def values(self, batches: list[TrainBatch | BatchShape]) -> list[torch.Tensor | None]:
        """The values [B, T] of this rank's batch under the current weights, None for the other ranks' batches
        (BatchShapes). FSDP ranks gather parameters together: each runs exactly one forward."""
        self.model.module.eval()
        with torch.no_grad():
            return [
                None if isinstance(b, BatchShape) else self._values(b.tokens, b.response_mask).cpu() for b in batches
            ]

    @endpoint
    async def step(self, batches: list[TrainBatch | BatchShape]) -> dict[str, float]:
        """`epochs` optimizer steps of the clipped value loss on the step's batches (each rank its own; every
        TrainBatch must carry `values`, the critic's before this step, and `returns`). The loss is a mean over
        the whole step's response tokens, so ranks and micro-batches sum to the batch's. The clip acts from the
        second epoch on: in the first the values being trained are the ones `values` just computed."""
        self.model.validate_everywhere(batches)
        batch = batches[self.model.dp_rank]
        if batch.values is None or batch.returns is None:
            raise ValueError(
                f"critic.step: batch[{self.model.dp_rank}] has no values/returns (compute them with "
                "critic.values and forge_rl.losses.ppo.gae first)"
            )
        start = time.perf_counter()
        total_seqs = sum(b.num_sequences for b in batches)
        total_tokens = sum(b.num_response_tokens for b in batches)
        mb = self.cfg.micro_batch_size or batch.num_sequences
        first, grad_norms = None, []
        self.model.module.train()
        for _ in range(self.epochs):
            sums = torch.zeros(2, dtype=torch.float64)  # the loss, tokens whose clipped term was the larger
            for lo in range(0, batch.num_sequences, mb):
                rows = slice(lo, lo + mb)
                mask = batch.response_mask[rows].to(self.model.device)
                v = self._values(batch.tokens[rows], batch.response_mask[rows])
                token_loss, clipped = value_loss(
                    v,
                    batch.values[rows].to(self.model.device),
                    batch.returns[rows].to(self.model.device),
                    self.value_clip,
                )
                loss = reduce_loss(token_loss, mask, "token_mean", total_seqs, total_tokens)
                loss.backward()
                sums += torch.tensor([loss.item(), float((clipped & mask).sum())], dtype=torch.float64)
            grad_norm, _ = apply_gradients(
                self.model, self.optimizer, self.scheduler, self.counts, self.cfg.optim.max_grad_norm, float(sums[0])
            )
            grad_norms.append(grad_norm)
            sums, _ = self.model.reduce_over_data_parallel(sums, 0.0)
            first = sums if first is None else first
            last = sums
        if self.cfg.release_memory_after_step and self.model.device.type == "cuda":
            torch.cuda.empty_cache()  # colocated: the engine's wake-up needs what the step cached (as the trainer's)
        elapsed = time.perf_counter() - start
        return dict(
            value_loss=float(first[0]),
            value_loss_last_epoch=float(last[0]),
            value_clip_fraction=float(last[1]) / total_tokens,
            grad_norm=grad_norms[0],
            step=self.counts.taken,
            step_s=elapsed,
            peak_rss_mb=peak_rss_mb(),
        )  # step: optimizer steps so far

    @endpoint
    async def data_shard(self) -> int:
        """This rank's data-parallel shard: the index of the batch it trains on."""
        return self.model.dp_rank

    @endpoint
    async def version(self) -> int:
        """Optimizer steps taken so far."""
        return self.counts.taken

    @endpoint
    async def save(self, step: int | None = None, path: str | None = None) -> str:
        """DCP checkpoint of the value model, its optimizer, schedule and step (forge_rl/actors/train_checkpoint.py)."""
        return await self.checkpoint.save(step, path)

    @endpoint
    async def load(self, path: str | None = None) -> int:
        """Restore what `save` wrote. Returns the step."""
        return self.checkpoint.load(path)

    @endpoint
    async def config(self) -> dict:
        return asdict(self.cfg)
