"""A trained model's optimizer: AdamW over its trainable parameters, the learning-rate schedule, and the count of
steps that versions the policy.

    optimizer, scheduler = build_optimizer(model, cfg.optim)
    counts = StepCounts(cfg.max_nonfinite_steps)
    grad_norm, finite = apply_gradients(model, optimizer, scheduler, counts, cfg.optim.max_grad_norm)

The Trainer's step does what `apply_gradients` does inline (its optimizer step is one hop from the step endpoint);
the roles that step on their own (the critic, the Tinker trainer) call it.
"""

import math
from dataclasses import dataclass

import torch

from forge_rl.actors.train_model import TrainModel
from forge_rl.actors.trainer_config import OptimizerConfig


def lr_lambda(cfg: OptimizerConfig):
    """Linear warm-up, then cosine decay to min_lr_ratio (or constant when decay_steps is 0)."""

    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / (cfg.warmup_steps + 1)
        if not cfg.decay_steps:
            return 1.0
        progress = min(1.0, (step - cfg.warmup_steps) / cfg.decay_steps)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def build_optimizer(
    model: TrainModel, cfg: OptimizerConfig
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over the parameters that train (with LoRA: the adapters only), and its schedule."""
    optimizer = torch.optim.AdamW(
        [p for p in model.module.parameters() if p.requires_grad],
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        # one kernel over every tensor (faster than foreach, which launches per tensor group); experts' parameters
        # live on another mesh than the rest, which the fused kernel does not take in one call
        **(dict(foreach=True) if model.parallel_dims.ep_enabled else dict(fused=True)),
    )
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))


@dataclass
class StepCounts:
    """Optimizer steps taken, skipped ones included (the policy version), and the skipped ones: a step whose gradient
    norm is not finite leaves the weights, optimizer state and schedule as they were; `max_nonfinite` of them in a
    row stop the run."""

    max_nonfinite: int
    taken: int = 0
    skipped: int = 0
    nonfinite_in_a_row: int = 0

    def count(self, finite: bool, loss: float) -> None:
        if finite:
            self.nonfinite_in_a_row = 0
        else:
            self.skipped += 1
            self.nonfinite_in_a_row += 1
        self.taken += 1  # the policy version advances either way, so versions stay in step with the run
        if self.nonfinite_in_a_row >= self.max_nonfinite:
            raise FloatingPointError(
                f"{self.nonfinite_in_a_row} train steps in a row had a non-finite gradient norm (loss {loss}); "
                f"stopping (trainer.max_nonfinite_steps={self.max_nonfinite}). Check rewards, behaviour "
                "logprobs and the learning rate"
            )


def apply_gradients(
    model: TrainModel, optimizer, scheduler, counts: StepCounts, max_grad_norm: float, loss: float = 0.0
) -> tuple[float, bool]:
    """Clip to `max_grad_norm` (0: no clipping), `optimizer.step()` unless the norm is not finite, clear the gradients
    and count the step. Returns (grad norm, finite)."""
    grad_norm = model.clip_grad_norm(max_grad_norm)  # global over ranks: every rank takes the same branch
    finite = math.isfinite(grad_norm)
    if finite:
        optimizer.step()
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    counts.count(finite, loss)
    return grad_norm, finite
