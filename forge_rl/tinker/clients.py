"""Several LoRA training clients on one trainer: the base model's processes are shared, each client's adapters,
gradients, optimizer, schedule and step count are its own.

    clients = TrainerClients(trainer)       # on the trainer's ranks
    clients.activate("session:1")           # its adapters into the model, the trainer's optimizer its own

The model holds one client's adapters at a time. Activating another puts the active client's adapters and their
accumulated gradients aside (they are small: rank x the linears' dims) and copies the other's in, so gradients of two
clients never mix and each client's calls run as if the trainer were its own. AdamW keeps its moments per parameter
object, so each client's own optimizer instance over the same parameters keeps its own. A new client starts from the
adapters the trainer was built with (trainer `seed`: B = 0, so training starts at the base model).
"""

from dataclasses import dataclass

import torch

from forge_rl.actors.train_checkpoint import TrainCheckpoint
from forge_rl.actors.train_optimizer import StepCounts, build_optimizer


@dataclass
class ClientState:
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    counts: StepCounts
    checkpoint: TrainCheckpoint
    adapters: dict[str, torch.Tensor] | None = None  # put aside while another client is active
    grads: dict[str, torch.Tensor | None] | None = None


class TrainerClients:
    def __init__(self, trainer):
        if not trainer.cfg.lora.enabled:
            raise ValueError("training clients share a trainer only with LoRA adapters (lora_rank > 0)")
        self.trainer = trainer
        self.params = {n: p for n, p in trainer.model.module.named_parameters() if p.requires_grad}
        self.initial = {n: p.detach().clone() for n, p in self.params.items()}
        self.states: dict[str, ClientState] = {}
        self.active: str | None = None

    def activate(self, client: str) -> None:
        """Make `client`'s adapters, gradients, optimizer, schedule and step count the trainer's."""
        if client == self.active:
            return
        if self.active is not None:
            self._put_aside(self.states[self.active])
        state = self.states.get(client) or self._new()
        self.states[client] = state
        with torch.no_grad():
            for name, p in self.params.items():
                p.copy_(state.adapters[name] if state.adapters is not None else self.initial[name])
                p.grad = state.grads[name] if state.grads is not None else None
        state.adapters = state.grads = None  # in the model now
        t = self.trainer
        t.optimizer, t.scheduler, t.counts, t.checkpoint = (
            state.optimizer,
            state.scheduler,
            state.counts,
            state.checkpoint,
        )
        self.active = client

    def forget(self, client: str) -> None:
        """A closed client's state dropped; the model's adapters are another's at its next activation."""
        self.states.pop(client, None)
        if self.active == client:
            self.active = None

    def _put_aside(self, state: ClientState) -> None:
        state.adapters = {n: p.detach().clone() for n, p in self.params.items()}
        state.grads = {n: p.grad for n, p in self.params.items()}
        for p in self.params.values():
            p.grad = None

    def _new(self) -> ClientState:
        t = self.trainer
        optimizer, scheduler = build_optimizer(t.model, t.cfg.optim)
        counts = StepCounts(t.cfg.max_nonfinite_steps)
        return ClientState(optimizer, scheduler, counts, TrainCheckpoint(t.model, optimizer, scheduler, counts))
