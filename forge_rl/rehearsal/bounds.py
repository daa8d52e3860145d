"""What a rehearsed rank may hold in each phase, from the memory plan (forge_rl/runtime/memory_plan.py), and the
rehearsal's findings against it.

- The plan per phase, per rank: in a train step, the plan's states 16P/W (fp32 params, grads, AdamW's moments),
  one RoPE cache, activations for one micro-batch and FSDP's largest unit made whole; in every other phase, the
  states and one block; loading also makes the one RoPE cache all layers share (forge_rl/models/qwen3.materialise),
  two caches' worth more for a moment. No CUDA context or NCCL buffers (TRAINER_OVERHEAD_GB): a rehearsal has none.
- Beyond its state, a rank may make no tensor larger than one block or its own largest shard (in fp32): a
  publish, checkpoint or export that holds a whole sharded parameter breaks that (the train step's FSDP all-gathers
  of one layer are its design, and are not held to it).
- Every element of every published and exported tensor is written exactly once, over all ranks.
- A reference policy holds its parameters only (4P/W: the plan's "its 4*P/n"), no gradients or moments; its score
  (a forward without gradients) is held to the parameters and a step's activations, its follow to one block more.
"""

from dataclasses import dataclass, replace

from forge_rl.runtime.memory_plan import LM_HEAD_MEMORY_GB, ModelShape, plan_memory
from forge_rl.runtime.vision_memory import tower_frozen

TOLERANCE = 0.10  # a rank's peak may exceed the plan by this much (the agreement asked of plan, docs and rehearsal)
BOUNDED_PHASES = ("load", "publish_shm", "publish_rank0", "save", "restore", "export", "follow")


@dataclass
class PhasePlan:
    bytes: dict[str, float]  # per phase
    block: int  # trainer.publish_block_mb in bytes
    states: float  # fp32 params, grads and AdamW's moments, and the RoPE cache


def rehearsed_head_mb(cfg) -> float:
    """The fused head's working memory a rehearsed rank uses: the GPU's auto budget unless the config sets one (the
    rehearsal runs on a CPU, whose own auto budget is larger)."""
    return cfg.lm_head_memory_mb or LM_HEAD_MEMORY_GB * 1e9 / 2**20


def phase_plan(hf_config: dict, cfg, world: int, seq_len: int, role: str = "trainer") -> PhasePlan:
    """The plan's bytes per rank in each phase, for the trainer (or PPO's critic, or a reference policy) of `cfg`
    over `world` ranks."""
    critic = role == "critic"
    shape = model = ModelShape.from_config(hf_config, "model")
    params, tp = shape.parameters(), cfg.parallel.tp
    if critic:  # the head is one value per position (and the embedding its own even if the policy ties them)
        h, vocab = shape.hidden_size, shape.vocab_size
        params += h - (0 if shape.tie_word_embeddings else vocab * h)
        shape = replace(shape, vocab_size=1)  # its "logits" are one per token
    plan = plan_memory(
        shape,
        1e15,
        trainer_ranks=world,
        micro_batch=cfg.micro_batch_size or 1,
        seq_len=seq_len,
        activation_checkpointing=cfg.parallel.activation_checkpointing,
        fused_lm_head=cfg.fused_lm_head and not critic,
        trainer_tp=tp,
        trainer_ep=cfg.parallel.ep,
        lm_head_memory_gb=rehearsed_head_mb(cfg) * 2**20 / 1e9,
        vision_trained=not tower_frozen(cfg.freeze),
    )
    step = plan.activations_gb * 1e9
    if critic and world // tp > 1:  # its largest FSDP unit is still the embedding
        step += model.fsdp_unit_bytes(tp) - shape.fsdp_unit_bytes(tp)
    block = int(cfg.publish_block_mb * 2**20)
    rope = shape.max_position_embeddings * 2 * shape.head_dim * 4  # one fp32 cos and sin per position
    states = (4 if role == "reference" else 16) * params / world + rope
    out = dict(first_step=states + step, train=states + step, score=states + step)
    for phase in BOUNDED_PHASES:
        out[phase] = states + block
    out["load"] += 2 * rope  # the one RoPE cache is made while to_empty's uninitialised one is alive, from cos and sin
    return PhasePlan(out, block, states)


def findings(result, plan: PhasePlan) -> list[str]:
    """Every way the rehearsal's ranks broke the plan: a peak above it (by more than TOLERANCE), a transient above
    one block or shard, a
    tensor not written exactly once. Empty when none."""
    out = [f"{phase}: {problem}" for phase, problems in result.coverage_problems().items() for problem in problems]
    for rank, phases in sorted(result.ranks.items()):
        bound = max(plan.block, result.shard_bytes.get(rank, 0))
        for phase, m in phases.items():
            if m.peak_bytes > (1 + TOLERANCE) * plan.bytes[phase]:
                out.append(
                    f"rank {rank} {phase}: peak {m.peak_bytes / 1e6:.3f} MB > plan {plan.bytes[phase] / 1e6:.3f} MB "
                    f"+ {TOLERANCE:.0%}"
                )
            if phase in BOUNDED_PHASES and m.largest.nbytes > bound:
                out.append(
                    f"rank {rank} {phase}: made a {m.largest.dtype} tensor {list(m.largest.shape)} of "
                    f"{m.largest.nbytes / 1e6:.3f} MB > one block or its largest shard ({bound / 1e6:.3f} MB) "
                    f"at {m.largest.where}"
                )
    return out
