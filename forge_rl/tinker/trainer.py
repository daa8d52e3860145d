"""The trainer behind a Tinker training client: forge_rl's Trainer (TorchTitan, FSDP2/TP, LoRA, its optimizer,
publishing and checkpoints) with the two calls the Tinker API splits a step into.

    forward_backward(rows, loss_fn, settings)   logprobs of each row's targets, the loss, gradients accumulated
    optim_step(adam)                             Adam's parameters of this call, clip, optimizer.step(), zero grads

A Tinker step is the client's, not the trainer's: gradients accumulate over any number of forward_backward calls
until optim_step, and the optimizer's learning rate and betas are the call's. Every rank runs each call; a rank
forwards its data-parallel share of the rows (round robin), so every rank runs one forward and one backward and
FSDP's collectives pair up; the gradients are summed over ranks, as the losses are sums. A sampled group's datums,
which begin alike, forward their prompt once (forge_rl/tinker/shared_prefixes.py).

With LoRA, one trainer serves every training client of the base model: `activate(client)` before a client's calls
makes its adapters, gradients and optimizer the trainer's (forge_rl/tinker/clients.py).
"""

from dataclasses import dataclass

import numpy as np
import torch
from monarch.actor import endpoint

from forge_rl.actors.train_optimizer import apply_gradients
from forge_rl.actors.trainer import Trainer
from forge_rl.tinker.clients import TrainerClients
from forge_rl.tinker.losses import INPUTS, token_loss
from forge_rl.tinker.shared_prefixes import SharedPrefixes


@dataclass
class Row:
    """One datum: its input tokens and, per input token, the target token and the loss inputs."""

    tokens: list[int]
    targets: list[int]
    inputs: dict[str, np.ndarray]


@dataclass
class AdamStep:
    learning_rate: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    grad_clip_norm: float  # 0: the trainer's own trainer.optim.max_grad_norm


class TinkerTrainer(Trainer):
    clients: TrainerClients | None = None  # made at the first activate

    @endpoint
    async def activate(self, client: str) -> None:
        """`client`'s adapters, gradients, optimizer and step count become the trainer's until another's are."""
        if self.clients is None:
            self.clients = TrainerClients(self)
        self.clients.activate(client)

    @endpoint
    async def forget(self, client: str) -> None:
        """A closed training client's adapters and optimizer state dropped."""
        if self.clients is not None:
            self.clients.forget(client)

    @endpoint
    async def forward_backward(
        self, rows: list[Row], loss_fn: str, settings: dict, forward_only: bool = False
    ) -> tuple[list[int], list[np.ndarray], float]:
        """This rank's share of `rows`: (their indices, each row's logprob per target token, their summed loss).
        Without `forward_only` the loss's gradients are added to the parameters' (no optimizer step)."""
        index = list(range(self.model.dp_rank, len(rows), self.model.dp_size))
        mine = [rows[i] for i in index] or [Row([0], [0], {})]  # a rank with no row still runs the collectives
        lengths = [len(r.tokens) for r in mine]
        tokens = torch.zeros(len(mine), max(lengths) + 1, dtype=torch.long)
        mask = torch.zeros_like(tokens, dtype=torch.bool)
        for b, r in enumerate(mine):
            tokens[b, : lengths[b] + 1] = torch.tensor(r.tokens + r.targets[-1:])
            mask[b, 1 : lengths[b] + 1] = True  # the logprob of target i sits at position i + 1
        self.model.module.train(not forward_only)
        with torch.set_grad_enabled(not forward_only):
            if self.model.cfg.share_prompts:  # a sampled group's prompt forwarded once (tinker/shared_prefixes.py)
                plan = SharedPrefixes.of(tokens, lengths)
                logprobs = plan.per_row(self.model.logprobs(tokens, "none", plan.mask, prompt_targets=True)[0])
            else:
                logprobs, _ = self.model.logprobs(tokens, "none", mask)
            targets = logprobs[:, 1:]  # [B, T]: target i's logprob at column i
            loss = logprobs.new_zeros(()) + 0.0 * logprobs.sum()  # every rank's backward reaches every parameter
            if index:  # the whole share's loss at once: one graph, not one per row
                inputs = {k: self._padded(mine, k, targets) for k in INPUTS[loss_fn] if k != "target_tokens"}
                per_token = token_loss(loss_fn, targets, inputs, settings)
                loss = loss + per_token.where(mask[:, 1:].to(per_token.device), 0.0).sum()
            if not forward_only:
                loss.backward()
        outputs = [logprobs[b, 1 : lengths[b] + 1].detach().float().cpu().numpy() for b in range(len(index))]
        return index, outputs, float(loss.detach())

    @staticmethod
    def _padded(rows: list[Row], key: str, like: torch.Tensor) -> torch.Tensor:
        """Each row's loss input `key`, right-padded with zeros into one [B, T] tensor of `like`'s dtype and device."""
        padded = np.zeros(tuple(like.shape), dtype=np.float32)
        for b, r in enumerate(rows):
            padded[b, : len(r.inputs[key])] = r.inputs[key]
        return torch.from_numpy(padded).to(like.device, like.dtype)

    @endpoint
    async def optim_step(self, adam: AdamStep) -> dict[str, float]:
        """One optimizer step on the gradients accumulated since the last: AdamW with this call's parameters, the
        gradient norm clipped to `grad_clip_norm` (else the trainer's max_grad_norm). A step whose norm is not
        finite changes nothing (Trainer's rule). Returns the step's metrics."""
        for group in self.optimizer.param_groups:
            group.update(
                lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), eps=adam.eps, weight_decay=adam.weight_decay
            )
        max_norm = adam.grad_clip_norm or self.cfg.optim.max_grad_norm
        grad_norm, finite = apply_gradients(self.model, self.optimizer, self.scheduler, self.counts, max_norm)
        return {"grad_norm:mean": grad_norm, "skipped:sum": float(not finite), "step:max": float(self.counts.taken)}

    @endpoint
    async def forget_optimizer_state(self) -> None:
        """Weights loaded without their optimizer: Adam's moments start again from zero, as a new client's do."""
        self.optimizer.state.clear()
