"""Rehearse a W-rank trainer on one CPU machine: every rank runs the Trainer's own endpoints, one rank after another,
with fake tensors (forge_rl/rehearsal/fake_memory.py) and a fake process group (fake_ranks.py), and each phase's
memory is recorded per rank.

    result = rehearse(Rehearsal(model_dir, TrainerConfig(...), world=32, seq_len=4096))
    result.ranks[r]["train"].peak_bytes; result.coverage_problems()

Phases (a Trainer's): load (`setup`: build, parallelise, sharded load), first_step and train (two `step`s of
one micro-batch per rank: forward, backward, optimizer; the first makes AdamW's moments, the second steps with them
as every later step does), publish_shm (`push_weights` with the ranks on one host: each writes its
shards), publish_rank0 (`push_weights` from rank 0: every rank streams blocks to it), save and restore (`save` and
`load`: DCP, each rank its own plan), export (`export_hf`). A critic (PPO) runs load, the two steps, save and restore.
A reference policy (KL penalty, distillation teacher) runs load, score (`fill_ref_logprobs`: one forward, no
gradient) and follow (`follow`: a published version read into its shards, as `reference.follow_every` does; the
version's file is the rehearsal's checkpoint, which has the publish layout).

Object collectives carry decisions between ranks (which rank sends which block), so the ranks run twice: a first
pass that records what each rank says in them (its tensor phases skipped: they say nothing; a phase that fails
because the rank heard only the ranks before it ends there), then the measured pass, in which each rank hears what
every other rank said.
"""

import asyncio
import contextlib
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from forge_rl.config import ConfigError
from forge_rl.deps.monarch import endpoint_function
from forge_rl.deps.torchtitan import balanced_routing
from forge_rl.rehearsal.bounds import rehearsed_head_mb
from forge_rl.rehearsal.fake_memory import FakeMemory, Largest
from forge_rl.rehearsal.fake_ranks import ObjectExchange, fake_rank
from forge_rl.rehearsal.recording import Coverage, RecordingStorage, RecordingStore, RecordingWriter, recorded_save_file
from forge_rl.rehearsal.sparse_checkpoint import fake_reads
from forge_rl.rehearsal.vision import frozen_hf_prefixes, image_row
from forge_rl.types import BatchShape, TrainBatch

# first_step makes AdamW's moments; train is the step after it, with them: a run's every step
TRAINER_PHASES = ("load", "first_step", "train", "publish_shm", "publish_rank0", "save", "restore", "export")
CRITIC_PHASES = ("load", "first_step", "train", "save", "restore")
REFERENCE_PHASES = ("load", "score", "follow")
PHASES = {"trainer": TRAINER_PHASES, "critic": CRITIC_PHASES, "reference": REFERENCE_PHASES}
TALKING_PHASES = ("load", "publish_shm", "publish_rank0", "export")  # the first pass runs these (object collectives)


@dataclass
class Rehearsal:
    model_dir: Path
    cfg: object  # TrainerConfig
    world: int
    seq_len: int
    role: str = "trainer"  # "trainer" (the policy's), "critic" (PPO's) or "reference" (frozen, forward only)
    ranks: list[int] | None = None  # which ranks to measure (default all; every rank runs the first pass)
    where_above: int = 1 << 20  # name the line that made a phase's largest tensor when it is at least this big


@dataclass
class PhaseMemory:
    before_bytes: int  # live when the phase started
    peak_bytes: int
    after_bytes: int
    largest: Largest
    host_block: int  # the largest block read from the checkpoint or handed to a writer


@dataclass
class Result:
    ranks: dict[int, dict[str, PhaseMemory]] = field(default_factory=dict)
    coverage: dict[str, Coverage] = field(default_factory=dict)  # publish_shm, publish_rank0, export
    shard_bytes: dict[int, int] = field(default_factory=dict)  # each rank's largest parameter shard, in fp32
    checkpoint_names: set[str] = field(default_factory=set)  # what a publish or export must hold, at least
    unpushed: tuple[str, ...] = ()  # HF name prefixes a publish leaves out (trainer.freeze's); an export holds all

    def coverage_problems(self) -> dict[str, list[str]]:
        """Per publish and export: tensors not written exactly once, and the checkpoint's tensors it lacks."""
        out = {}
        for name, c in self.coverage.items():
            problems = c.problems()
            expected = self.checkpoint_names
            if name.startswith("publish"):
                expected = {n for n in expected if not n.startswith(self.unpushed)}
            if name.startswith("publish") and (sent := [n for n in c.spec if n.startswith(self.unpushed)]):
                problems.append(f"{len(sent)} frozen tensors pushed, e.g. {sent[0]}")
            if missing := sorted(expected - set(c.spec)):
                problems.append(
                    f"{len(missing)} of the checkpoint's {len(self.checkpoint_names)} tensors are not "
                    f"in it, e.g. {missing[0]}"
                )
            if problems:
                out[name] = problems
        return out


def call(actor, name: str, *args):
    """Run endpoint `name` of `actor` as Monarch would, on this plain instance."""
    return asyncio.run(endpoint_function(getattr(type(actor), name))(actor, *args))


def batches_for(trainer, micro_batch: int, seq_len: int, critic: bool = False) -> list[TrainBatch | BatchShape]:
    """One micro-batch of distinct prompts (nothing for prompt sharing to pack) of `seq_len` tokens, half prompt, for
    this rank's data shard; the other shards' counts. Made from numpy arrays: real data even inside FakeMemory, which
    makes floating-point tensors made out of nothing fake."""
    import numpy as np

    model = trainer.model
    rng = np.random.default_rng(model.dp_rank)
    mask = np.zeros((micro_batch, seq_len), dtype=bool)
    mask[:, seq_len // 2 :] = True
    per_token = (rng.standard_normal((micro_batch, seq_len)) * mask).astype(np.float32)
    tokens, images = rng.integers(3, model.vocab_size, (micro_batch, seq_len)), None
    if (tower := getattr(model.module, "vision", None)) is not None:  # each row's prompt starts with its own image
        tokens[tokens == tower.image_token_id] = 3
        rows = [image_row(tower, model.image_processor, rng) for _ in range(micro_batch)]
        n = rows[0][1]  # the images are alike but for their pixels
        if n >= seq_len // 2:
            raise ConfigError(
                f"generator.engine_args.max_model_len={seq_len}: a row's image makes {n} tokens, more than the "
                f"rehearsal's prompt half ({seq_len // 2}); raise it"
            )
        tokens[:, 1 : 1 + n] = tower.image_token_id
        images = [(image,) for image, _ in rows]
    t = torch.from_numpy
    batch = TrainBatch(
        t(tokens),
        t(mask),
        t((-rng.random((micro_batch, seq_len)) * mask).astype(np.float32)),
        t(np.where(mask, 0, -1).astype(np.int64)),
        t(per_token) if critic else t(rng.standard_normal(micro_batch).astype(np.float32)),
        values=t(per_token) if critic else None,
        returns=t(per_token.copy()) if critic else None,
        images=images,
    )
    return [batch if r == model.dp_rank else batch.shape_only() for r in range(model.dp_size)]


class _Run:
    """What every rank shares: the object exchange, the recording stores, the DCP storages, a scratch directory."""

    def __init__(self, spec: Rehearsal, scratch: Path):
        self.spec, self.scratch = spec, scratch
        self.exchange = ObjectExchange(spec.world)
        self.result = Result()

    def rank(self, rank: int, phases: tuple[str, ...], measure: bool) -> None:
        memory = FakeMemory(where_above=self.spec.where_above)
        coverage = self.result.coverage if measure else {}
        with (
            fake_rank(rank, self.spec.world, self.exchange),
            fake_reads(memory),
            _dcp_through(memory),
            _export_through(coverage, memory),
            balanced_routing(),
            memory,
        ):
            trainer = self._trainer()
            store = RecordingStore(memory, published=self.spec.model_dir)
            if self.spec.role == "reference":  # `follow` reads through it
                trainer.store = store
            out = {}
            for phase in phases:
                self.exchange.start(rank, phase)
                memory.phase()
                before = memory.live_bytes
                try:
                    self._phase(trainer, phase, coverage, memory)
                except Exception:
                    if measure:
                        raise
                    # the first pass: a rank hears only the ranks before it, and what it decides from the others'
                    # words may fail; what it said up to there is recorded, which is what this pass is for
                out[phase] = PhaseMemory(
                    before, memory.peak_bytes, memory.live_bytes, memory.largest, memory.host_block
                )
                if phase == "load" and self.spec.role == "trainer":  # the publishes write into it
                    trainer.weights.store = store
                if phase == "load" and measure:
                    self.result.shard_bytes[rank] = _largest_shard(trainer.model.module)
            del trainer
        if measure:
            self.result.ranks[rank] = out

    def _trainer(self):
        from forge_rl.actors.critic import Critic
        from forge_rl.actors.reference import Reference
        from forge_rl.actors.trainer import Trainer

        cfg = replace(
            self.spec.cfg,
            model=str(self.spec.model_dir),
            checkpoint_dir=str(self.scratch / "ckpt"),
            lm_head_memory_mb=rehearsed_head_mb(self.spec.cfg),
        )
        return {"trainer": Trainer, "critic": Critic, "reference": Reference}[self.spec.role](cfg)

    def _phase(self, trainer, phase: str, coverage: dict, memory: FakeMemory) -> None:
        if phase == "load":
            call(trainer, "setup")
        elif phase in ("first_step", "train"):
            batches = batches_for(
                trainer, trainer.cfg.micro_batch_size or 1, self.spec.seq_len, self.spec.role == "critic"
            )
            call(trainer, "step", batches)
        elif phase == "score":
            call(
                trainer, "fill_ref_logprobs", batches_for(trainer, trainer.cfg.micro_batch_size or 1, self.spec.seq_len)
            )
        elif phase == "follow":
            call(trainer, "follow", 1)
        elif phase.startswith("publish"):
            trainer.cfg.publish_from = "auto" if phase == "publish_shm" else "rank0"
            version = 1 if phase == "publish_shm" else 2
            call(trainer, "push_weights", version)
            if version in trainer.weights.store.versions:
                coverage[phase] = _merged(coverage.get(phase), trainer.weights.store.versions.pop(version))
        elif phase == "save":
            call(trainer, "save", 1, str(self.scratch / "ckpt" / "step-1"))
        elif phase == "restore":
            call(trainer, "load", str(self.scratch / "ckpt" / "step-1"))
        elif phase == "export":
            call(trainer, "export_hf", str(self.scratch / "export"))


def _checkpoint_names(model_dir: Path) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(Path(model_dir) / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


def _largest_shard(model) -> int:
    return max(getattr(p, "_local_tensor", p).numel() * 4 for p in model.parameters())


def _merged(into: Coverage | None, more: Coverage) -> Coverage:
    if into is None:
        return more
    into.expect(more.spec)
    for name, boxes in more.boxes.items():
        into.boxes.setdefault(name, []).extend(boxes)
    into.largest_piece = max(into.largest_piece, more.largest_piece)
    return into


@contextlib.contextmanager
def _dcp_through(memory: FakeMemory):
    """DCP's save and load with a recording storage, each rank its own plan (no_dist): the state dict, the planners
    and the per-item reads and writes run; the plans' exchange between ranks, which moves no tensor, does not."""
    import torch.distributed.checkpoint as dcp

    storage = RecordingStorage(memory)
    real_save, real_load = dcp.save, dcp.load

    def save(state_dict, *, checkpoint_id=None, **kwargs):
        return real_save(state_dict, checkpoint_id=checkpoint_id, storage_writer=storage, no_dist=True)

    def load(state_dict, *, checkpoint_id=None, **kwargs):
        return real_load(state_dict, checkpoint_id=checkpoint_id, storage_reader=storage, no_dist=True)

    dcp.save, dcp.load = save, load
    try:
        yield
    finally:
        dcp.save, dcp.load = real_save, real_load


@contextlib.contextmanager
def _export_through(coverage: dict, memory: FakeMemory):
    """The HF export's writes recorded: safetensors' save_file (an export that writes whole tensors) and the
    trainer's `WeightsOut.open_export` writer (one that streams blocks), whichever the trainer uses."""
    import safetensors.torch

    from forge_rl.actors.weights_out import WeightsOut

    exported = coverage.setdefault("export", Coverage()) if coverage is not None else Coverage()
    real_save_file, real_open_export = safetensors.torch.save_file, WeightsOut.open_export
    safetensors.torch.save_file = recorded_save_file(exported, memory)
    WeightsOut.open_export = lambda self, out_dir, spec: RecordingWriter(exported, spec, memory)
    try:
        yield
    finally:
        safetensors.torch.save_file, WeightsOut.open_export = real_save_file, real_open_export


def rehearse(spec: Rehearsal, progress=None) -> Result:
    """Both passes over the ranks (see the module's docstring). `progress(rank, pass)` is called before each rank."""
    if spec.role not in PHASES:
        raise ValueError(f"Rehearsal.role={spec.role!r}: one of {sorted(PHASES)}")
    phases = PHASES[spec.role]
    measured = spec.ranks if spec.ranks is not None else list(range(spec.world))
    with tempfile.TemporaryDirectory(prefix="rehearsal-") as tmp:
        run = _Run(spec, Path(tmp))
        if spec.role == "trainer":
            run.result.checkpoint_names = _checkpoint_names(spec.model_dir)
            run.result.unpushed = tuple(frozen_hf_prefixes(spec.cfg.freeze))
        talking = tuple(p for p in phases if p in TALKING_PHASES)
        for rank in range(spec.world):
            if progress:
                progress(rank, 1)
            run.rank(rank, talking, measure=False)
        for rank in measured:
            if progress:
                progress(rank, 2)
            run.rank(rank, phases, measure=True)
    return run.result
