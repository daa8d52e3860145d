"""Training clients on the service's base model: LoRA adapters of the service's rank, every client on one shared
TinkerTrainer (forge_rl/tinker/trainer.py) whose `activate` makes the client's adapters and optimizer its own; with
every weight trained (lora_rank 0) each client has a trainer of its own. Calls to one trainer run one at a time in
the order they arrived (its lock is first come, first served), and each checks its inputs before the trainer sees
them, so a refused call changes nothing and the next one runs."""

import asyncio
import itertools
from dataclasses import dataclass, field

import numpy as np

from forge_rl.actors.trainer_config import OptimizerConfig, TrainerConfig
from forge_rl.models.lora_config import LoRAConfig
from forge_rl.tinker.config import TinkerConfig
from forge_rl.tinker.errors import Refused
from forge_rl.tinker.losses import INPUTS, check_loss
from forge_rl.tinker.trainer import AdamStep, Row, TinkerTrainer
from forge_rl.tinker.wire import ForwardBackwardCall, forward_backward_output


@dataclass
class TrainingModel:
    model_id: str
    owner: str
    trainer: object  # the TinkerTrainer actor mesh: the shared one under LoRA
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # the trainer's: shared by the clients sharing it
    shared: bool = False  # on the shared trainer: `use` before each call
    steps: int = 0  # optimizer steps taken
    closed: bool = False  # its session finished: its trainer is stopped, or its state on the shared one dropped

    async def use(self) -> None:
        """Make this client's adapters and optimizer the trainer's (holding `lock`, before calling the trainer)."""
        if self.shared:
            await self.trainer.activate.call(self.model_id)


def trainer_config(cfg: TinkerConfig, model_dir: str, checkpoint_dir: str, seed: int) -> TrainerConfig:
    return TrainerConfig(
        model=model_dir,
        lora=LoRAConfig(rank=cfg.lora_rank, alpha=cfg.lora_alpha),
        share_prompts=True,  # consecutive datums beginning alike (a group) forward it once (tinker/shared_prefixes.py)
        optim=OptimizerConfig(max_grad_norm=cfg.max_grad_norm),
        dtype=cfg.trainer_dtype,
        checkpoint_dir=checkpoint_dir,
        seed=seed,
    )


class Training:
    def __init__(self, cfg: TinkerConfig, model_dir: str, vocab_size: int, cores: dict | None = None):
        self.cfg, self.model_dir, self.vocab_size = cfg, model_dir, vocab_size
        self.cores = cores or {}  # every trainer's cores and threads (actor options; forge_rl/tinker/service.py)
        self.models: dict[str, TrainingModel] = {}
        self.shared: tuple[object, asyncio.Lock] | None = None  # LoRA: the trainer every client uses, and its lock
        self._ids = itertools.count(1)

    def model(self, owner: str, model_id: str) -> TrainingModel:
        """The owner's model; another key's model is as unknown as one that does not exist."""
        found = self.models.get(model_id)
        if found is None or found.owner != owner:
            raise Refused(f"no training client {model_id!r} for this key: create one with create_lora_training_client")
        return found

    async def create(self, owner: str, model_id: str, base_model: str, rank: int | None, seed: int | None) -> dict:
        """A new training client `model_id` (the client names it: session and sequence number): its own trainer on
        the base model."""
        self.cfg.check_base_model(base_model, self.model_dir)
        if rank is not None and self.cfg.lora_rank and rank != self.cfg.lora_rank:
            raise Refused(
                f"LoRA rank {rank}: this server trains rank {self.cfg.lora_rank}; pass rank={self.cfg.lora_rank}"
            )
        if len(self.models) >= self.cfg.max_training_clients:
            raise Refused(
                f"this server holds {len(self.models)} training clients, its max_training_clients: close a "
                "ServiceClient (service_client.close(...)) to free its own, or start the server with more"
            )
        if model_id in self.models:
            raise Refused(f"a training client {model_id!r} exists already: create a new one from a new session")
        if not self.cfg.lora_rank:
            self.models[model_id] = TrainingModel(model_id, owner, await self._trainer(seed or self.cfg.seed))
        else:  # every client's adapters start from the service seed's (B = 0: at the base model)
            if self.shared is None:
                self.shared = (await self._trainer(self.cfg.seed), asyncio.Lock())
            trainer, lock = self.shared
            self.models[model_id] = TrainingModel(model_id, owner, trainer, lock, shared=True)
        return {"model_id": model_id, "type": "create_model"}

    async def _trainer(self, seed: int) -> TinkerTrainer:
        name = f"trainer-{next(self._ids)}"  # its procs and checkpoints: a client's id holds ':'
        tcfg = trainer_config(self.cfg, self.model_dir, f"{self.cfg.output_dir}/{name}", seed)
        options = dict(procs=self.cfg.trainer_procs, spmd=True, mesh_name=name, **self.cores)
        return await TinkerTrainer.options(**options).as_actor(tcfg)

    def rows(self, call: ForwardBackwardCall, loss_fn: str) -> list[Row]:
        """The call's datums as trainer rows, each checked: one line names the first that is wrong."""
        if not call.data:
            raise Refused("forward_backward with no datums: send at least one")
        if len(call.data) > self.cfg.max_batch_datums:
            raise Refused(
                f"{len(call.data)} datums in one call, over this server's max_batch_datums="
                f"{self.cfg.max_batch_datums}; split the batch over several forward_backward calls, then one optim_step"
            )
        return [self._row(i, d.tokens, d.inputs, loss_fn) for i, d in enumerate(call.data)]

    def _row(self, i: int, tokens: list[int], inputs: dict[str, np.ndarray], loss_fn: str) -> Row:
        n = len(tokens)
        if not 0 < n <= self.cfg.max_sequence_tokens:
            raise Refused(f"datum {i}: {n} input tokens; give 1 to max_sequence_tokens={self.cfg.max_sequence_tokens}")
        missing = [k for k in INPUTS[loss_fn] if k not in inputs]
        if missing:
            raise Refused(f"datum {i}: loss_fn_inputs lacks {missing}, which {loss_fn!r} needs")
        for name, value in inputs.items():
            if value.shape != (n,):
                raise Refused(
                    f"datum {i}: loss_fn_inputs[{name!r}] has {value.size} values for {n} input tokens; give one per "
                    "input token"
                )
        targets = inputs["target_tokens"].astype(np.int64).tolist()
        if min(tokens + targets) < 0 or max(tokens + targets) >= self.vocab_size:
            raise Refused(f"datum {i}: a token id outside the vocabulary [0, {self.vocab_size})")
        if targets[:-1] != tokens[1:]:
            raise Refused(
                f"datum {i}: target_tokens must be the input tokens shifted by one (target i = input i + 1), as "
                "for next-token prediction; this server does not train other targets"
            )
        rest = {k: v.astype(np.float32) for k, v in inputs.items() if k != "target_tokens"}
        return Row(tokens, targets, rest)

    async def forward_backward(self, owner: str, call: ForwardBackwardCall) -> bytes:
        model = self.model(owner, call.model_id)
        loss_fn = call.loss_fn
        settings = check_loss(loss_fn, call.loss_config)
        rows = self.rows(call, loss_fn)
        async with model.lock:
            await model.use()
            results = await model.trainer.forward_backward.call(rows, loss_fn, settings, call.forward_only)
        # ranks of one tensor-parallel group return the same rows: each data-parallel share counts once
        shares = {tuple(index): (index, logprobs, loss) for index, logprobs, loss in results.values()}
        outputs: list = [None] * len(rows)
        for index, logprobs, _ in shares.values():
            for i, lp in zip(index, logprobs):
                outputs[i] = {"logprobs": lp}
        loss = sum(loss for index, _, loss in shares.values() if index)
        return forward_backward_output(outputs, {"loss:sum": loss})

    async def optim_step(self, owner: str, model_id: str, params: dict) -> dict:
        model = self.model(owner, model_id)
        adam = AdamStep(**{k: float(params[k]) for k in AdamStep.__dataclass_fields__})
        if not adam.learning_rate >= 0:
            raise Refused(f"learning_rate={adam.learning_rate}: give a finite learning rate >= 0")
        async with model.lock:
            await model.use()
            results = await model.trainer.optim_step.call(adam)
            model.steps += 1
        return {"metrics": next(iter(results.values()))}

    async def release(self, owner: str, session_id: str) -> None:
        """A finished session's training clients: their trainers stopped, their slots free."""
        from forge_rl.runtime.actor import stop_actor

        for model_id in [m for m, model in self.models.items() if model.owner == owner and m.startswith(session_id)]:
            model = self.models.pop(model_id)
            async with model.lock:
                model.closed = True
                if model.shared:
                    await model.trainer.forget.call(model_id)
                else:
                    await stop_actor(model.trainer)

    async def stop(self) -> None:
        from forge_rl.runtime.actor import stop_actor

        for model in self.models.values():
            if not model.shared:
                await stop_actor(model.trainer)
        if self.shared is not None:
            await stop_actor(self.shared[0])
