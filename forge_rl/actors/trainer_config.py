"""The Trainer's configuration (`trainer.*` in a run's config; the critic's and the reference's are made from it):
the model, the loss and its settings, micro-batches and prompt packing, parallelism, LoRA, the optimizer and its
schedule, dtypes, publishing, checkpoints and profiling, each checked when the config is made. The Trainer that runs
it is forge_rl/actors/trainer.py; this module imports no torch, Monarch or TorchTitan, so a run's config is read and
checked before any actor starts.
"""

import math
from dataclasses import dataclass, field
from typing import ClassVar

from forge_rl.losses.config import LossConfig
from forge_rl.models.lora_config import LoRAConfig

DTYPES = ("float32", "bfloat16")


@dataclass
class ParallelConfig:
    dp_shard: int = -1  # FSDP2 degree; -1 = all ranks not used by tp
    tp: int = 1  # tensor-parallel degree
    # expert-parallel degree (Qwen3-MoE): each expert lives on ep of the ranks' share, tokens travel to their
    # experts by all-to-all. EP borrows ranks from FSDP (and TP): dp_shard * tp must be a multiple of ep
    ep: int = 1
    activation_checkpointing: bool = False
    compile: bool = False


@dataclass
class OptimizerConfig:
    lr: float = 1e-5
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0  # 0 = no clipping
    warmup_steps: int = 0  # linear warm-up from 0
    decay_steps: int = 0  # cosine decay to min_lr_ratio * lr over these steps after warm-up; 0 = constant
    min_lr_ratio: float = 0.0

    def __post_init__(self) -> None:  # the trainer's (trainer.optim) or the critic's (critic.optim)
        if not (math.isfinite(self.lr) and self.lr >= 0):
            raise ValueError(f"optim.lr={self.lr}: the learning rate must be a finite number >= 0")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ValueError(f"optim.beta1={self.beta1}, optim.beta2={self.beta2}: each must be in [0, 1)")
        for name in ("eps", "weight_decay", "max_grad_norm", "warmup_steps", "decay_steps"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"optim.{name} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")


@dataclass
class TrainerConfig:
    RENAMED: ClassVar[dict[str, str]] = {"grpo": "loss"}
    MEANING_CHANGED: ClassVar[dict[str, str]] = {
        "loss": "trainer.loss is the RL loss's section, formerly trainer.grpo; "
        "the objective (rl, sft) is now trainer.objective"
    }

    model: str = "tiny"  # "tiny" (embedded) or a local HF model directory
    # "rl": the policy-gradient loss below; "sft": cross-entropy on the target tokens (the SFT recipe sets it)
    objective: str = "rl"
    loss: LossConfig = field(default_factory=LossConfig)  # the RL loss family (forge_rl/losses/config.py)
    # The policy being trained is softmax(logits / T). RL apps set T from the generator's sampling config
    # (forge_rl.loop.sampling); None here means 1.0.
    temperature: float | None = None
    micro_batch_size: int = 0  # sequences per forward/backward on a rank; 0 = the rank's whole batch
    # Pack the responses of one group with a single copy of their shared prompt (same logprobs and
    # gradients, fewer tokens; forge_rl.data.prompt_packing), when that costs at most pack_max_fraction of
    # the unpacked forward (tokens through the linear layers, plus attention's pairs) in rows of at most
    # pack_max_len.
    share_prompts: bool = True
    pack_max_fraction: float = 0.9
    pack_max_len: int = 1024
    # Compute logprobs straight from the final hidden states and the lm_head weight, a block of positions
    # at a time, so the logits and their gradient need not exist whole (forge_rl.losses.fused_head). Applies
    # when the lm_head is whole on each rank (no FSDP, no TP); otherwise logits are made, then blockwise.
    fused_lm_head: bool = True
    # The fused head's working memory per micro-batch: its blocks of logits, and the whole micro-batch's logits
    # kept for the backward when they fit in half of it (no recomputed matmul). 0 = auto: 1 GiB on a GPU, 2 GiB
    # on a CPU (forge_rl.losses.fused_head.default_memory_bytes)
    lm_head_memory_mb: float = 0.0
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    # LoRA (rank > 0): only adapters train; the base stays frozen, is never re-sent to generators, and
    # checkpoints hold the adapters and their optimizer state (forge_rl/models/lora.py).
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    # Parameters that do not train, by the trainer's module names (a name and everything under it): e.g. ["vision"]
    # (a vision-language model's tower and connector) or ["vision.vision_model"] (the tower alone). They are left
    # out of the optimizer and never re-sent to the generators, which keep the checkpoint's.
    freeze: list[str] = field(default_factory=list)
    # Mixture of experts: weight of the load-balancing loss added to the policy loss (forge_rl/models/moe_aux.py,
    # HF Qwen3-MoE's router_aux_loss_coef; 0 = none, the default)
    moe_aux_loss_coef: float = 0.0
    # Keep Routing (mixture of experts): every router uses the experts the engine routed each token to, recorded by
    # the generators (TrainBatch.routes; forge_rl/models/route_replay.py). The run makes its generators record them
    keep_routing: bool = False
    optim: OptimizerConfig = field(default_factory=OptimizerConfig)
    # Compute dtype. Master weights, gradients' reduction and optimizer state stay float32 whatever this is:
    # FSDP2's mixed-precision policy casts parameters for compute when dp_shard > 1, torch.autocast does
    # otherwise. (A bf16 master copy would round updates of ~lr 1e-6 on weights near 0.02 to nothing.)
    dtype: str = "float32"
    publish_dtype: str | None = None  # dtype of the weights pushed to generators; None = `dtype`
    # Give the step's cached GPU memory back after each publish: set by the run when the trainer time-shares its
    # GPU with a vLLM engine (colocated), whose wake-up needs that memory.
    release_memory_after_step: bool = False
    checkpoint_dir: str = "outputs/checkpoints"
    # A step whose gradient norm is NaN/inf leaves the weights untouched and is counted; this many in a
    # row end the run (something is broken: data, rewards, the learning rate).
    max_nonfinite_steps: int = 3
    # "auto": ranks on one host each write their own shards into shared memory; ranks on several hosts send
    # theirs to rank 0, which writes. "rank0": the latter on one host too
    publish_from: str = "auto"
    # publishing from rank 0: each rank sends its shards in blocks of rows of at most this size (the most any rank
    # holds beyond its state); bigger blocks, fewer messages
    publish_block_mb: float = 64.0
    # any one collective of the process group (a hung rank raises instead of blocking forever); the GRPO run
    # sets it from timeouts.collective_s
    collective_timeout_s: float = 1800.0
    seed: int = 0
    # torch.profiler over these steps (consecutive ones are one window): each rank writes a Chrome trace per window
    # into profile_dir, and at a window's last step Trainer.step returns the rank's top operators as
    # metrics["profile/summary"] (forge_rl/observability/profiler.py). A run sets profile_dir to output_dir/profile
    profile_steps: list[int] = field(default_factory=list)
    profile_dir: str = "profile"

    def vision_refusal(self) -> str | None:
        """What the vision-language path does not do yet (forge_rl/models/vision_language.py), naming the key."""
        for key, used in (
            ("trainer.parallel.tp", self.parallel.tp > 1),
            ("trainer.parallel.compile", self.parallel.compile),
            ("trainer.lora.rank", self.lora.enabled),
            ("trainer.keep_routing", self.keep_routing),
        ):
            if used:
                return f"{key}: not available for a vision-language model yet (FSDP2 over whole weights is); unset it"
        return None

    def __post_init__(self) -> None:
        if self.objective not in ("rl", "sft"):
            raise ValueError(f"trainer.objective={self.objective!r}; choose 'rl' or 'sft'")
        if not 0 < self.pack_max_fraction <= 1:
            raise ValueError(f"trainer.pack_max_fraction must be in (0, 1], got {self.pack_max_fraction}")
        if self.pack_max_len < 1:
            raise ValueError(f"trainer.pack_max_len must be >= 1, got {self.pack_max_len}")
        if self.publish_from not in ("auto", "rank0"):
            raise ValueError(f"trainer.publish_from={self.publish_from!r}; choose 'auto' or 'rank0'")
        if self.publish_block_mb <= 0:
            raise ValueError(f"trainer.publish_block_mb must be > 0, got {self.publish_block_mb}")
        if self.micro_batch_size < 0:
            raise ValueError(
                f"trainer.micro_batch_size must be >= 0 (0: a rank's whole batch at once), got {self.micro_batch_size}"
            )
        if not self.lm_head_memory_mb >= 0:
            raise ValueError(f"trainer.lm_head_memory_mb must be >= 0 (0: auto), got {self.lm_head_memory_mb}")
        if self.max_nonfinite_steps < 1:
            raise ValueError(f"trainer.max_nonfinite_steps must be >= 1, got {self.max_nonfinite_steps}")
        if not self.moe_aux_loss_coef >= 0:
            raise ValueError(f"trainer.moe_aux_loss_coef must be >= 0, got {self.moe_aux_loss_coef}")
        if self.temperature is not None and self.temperature <= 0:
            raise ValueError(f"trainer.temperature must be > 0, got {self.temperature}")
        if self.dtype not in DTYPES:
            raise ValueError(f"trainer.dtype={self.dtype!r}; choose one of {DTYPES}")
        if self.publish_dtype is not None and self.publish_dtype not in DTYPES:
            raise ValueError(
                f"trainer.publish_dtype={self.publish_dtype!r}; choose one of {DTYPES} (or leave it unset)"
            )
        if any(s < 1 for s in self.profile_steps):
            raise ValueError(f"trainer.profile_steps={list(self.profile_steps)}: steps are numbered from 1")
