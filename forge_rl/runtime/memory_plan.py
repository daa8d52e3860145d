"""The memory plan of a colocated GPU: what the trainer keeps on it, what the vLLM engine gets, how many KV tokens
that leaves, and a refusal with the numbers when it cannot work.

    shape = ModelShape.from_config("/models/Qwen3-1.7B/config.json")
    plan = plan_memory(shape, gpu_bytes=80e9, micro_batch=4, seq_len=2048, max_model_len=2048)
    print(plan.describe()); plan.check()   # ConfigError naming the model, the GBs and the keys to change

    python -m forge_rl.runtime.memory_plan --model-config PATH/config.json --gpu-gb 80

Colocated, the engine sleeps while the trainer steps (vLLM sleep level 1: its weights go to the host and its KV
cache is dropped), and the trainer keeps its states on the GPU while the engine generates. GB = 1e9 bytes.
P = parameters, n = trainer ranks (FSDP2 shards over them; one rank per GPU), t = a replica's tensor_parallel_size,
h, L, I, V, a, k, d = hidden, layers, intermediate, vocabulary, attention heads, KV heads, head dim.

- P = V*h (+ V*h for an untied lm_head) + h (final norm) + L * [h*a*d (q) + 2*h*k*d (k, v) + a*d*h (o)
  (+ a*d + 2*k*d q/k/v biases) + 3*h*I (gate, up, down) + 2*h (two norms) (+ 2*d: Qwen3's q/k norms)].
  Mixture of experts (Qwen3-MoE: E experts of intermediate size I_e, top K, every layer sparse): the MLP's 3*h*I
  is E*3*h*I_e + E*h (the router).
- trainer states per GPU: 16*P/n bytes: fp32 master params 4, fp32 grads 4, Adam's two fp32 moments 8. With the
  optimizer offloaded (`offload_optimizer=True`: a what-if the sizing table shows; the trainer does not offload
  yet) only the params (4*P/n) would stay while the engine generates, the grads (4*P/n) on the GPU during a
  step and the optimizer stepping on the host. LoRA: the frozen fp32 base only.
  A frozen reference policy (KL penalty) adds its 4*P/n; PPO's critic, trained on the same ranks, its 16*P/n.
  Plus TRAINER_OVERHEAD_GB (CUDA context, NCCL).
- trainer activations per GPU during a step (bf16, flash attention: 34 bytes per token per hidden unit per layer,
  Korthikanti et al. 2022), tokens = micro_batch * seq_len:
      without activation checkpointing: tokens * h * 34 * L
      with activation checkpointing:    tokens * h * (2*L + 34)   (each layer's bf16 input, one layer recomputed)
  divided by tp under tensor parallelism (TorchTitan shards the activations between layers over the TP ranks:
  sequence parallelism, Korthikanti et al.'s 34 s b h / t), plus, when the lm_head is not fused (TP ranks, or
  trainer.fused_lm_head off), the rank's vocabulary shard of the logits in bf16: tokens * V/tp * 2 (the
  log-softmax runs blockwise: forge_rl/losses/logprobs.py). FSDP ranks fuse the head and hold at most its working
  memory, min(trainer.lm_head_memory_mb (auto: 1 GiB on a GPU), tokens * V * 10) (forge_rl/losses/fused_head.py:
  bf16 logits and two fp32 buffers per logit of a block): the rehearsal (forge_rl/rehearsal) shows no rank
  making the logits whole.
  Plus, under FSDP (n / tp > 1), its largest unit made whole for the unit's forward and backward: parameters in bf16
  and their fp32 gradient before the reduce-scatter, 6 * max(V*h, one layer's parameters) / tp (the head's at
  Qwen3's sizes: 3.7 GB at 8B on one TP rank, 0.6 GB at 32B over TP 8). Under expert parallelism (ep) a layer
  made whole holds its own 1/ep of the experts only: its other parameters + E*3*h*I_e / ep.
  A mixture-of-experts layer's activations per token: Korthikanti's 34*h less its MLP's 19*h, plus the MoE block:
  its input 2*h, each token's K copies routed in and out 4*K*h, the K experts' SwiGLU intermediates 8*K*I_e and
  the router's fp32 logits and scores 8*E (an evenly loaded batch: the rehearsal routes evenly; a skewed one holds
  more on the ranks whose experts are popular).
  A vision-language model's tower (forge_rl/runtime/vision_memory.py), every token taken for an image token: one
  encoder layer's activations per token (a frozen tower), or every layer's (a trained one).
- engine per GPU: weights P * dtype bytes / t, ENGINE_OVERHEAD_GB (profile activations, CUDA graphs, sampler);
  KV cache per token (a whole replica): 2 * L * k * d * dtype bytes.
- gpu_memory_utilization = (GPU - trainer resident - margin) / GPU;
  KV tokens = (utilization * GPU - engine weights - engine overhead) * t / KV bytes per token.
- refused when the trainer's states (with its step-time grads) do not fit the GPU, or when the KV tokens are
  fewer than max_model_len * max_num_seqs (max_num_seqs set), else one max_model_len sequence (what vLLM
  needs to start). Activations are an upper-bound estimate (seq_len = max_model_len): a warning, not a refusal.
"""

import argparse
import json
import math
import subprocess
from dataclasses import dataclass, field, replace
from pathlib import Path

from forge_rl.config import ConfigError
from forge_rl.runtime.vision_memory import vision_shape

GB = 1e9
LM_HEAD_MEMORY_GB = 2**30 / GB  # the fused head's auto working memory on a GPU (forge_rl/losses/fused_head.py)
TRAINER_OVERHEAD_GB = 1.0
ENGINE_OVERHEAD_GB = 2.0
MARGIN_GB = 2.0
DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "auto": 2}


@dataclass(frozen=True)
class ModelShape:
    """The figures of a dense decoder (Llama/Qwen-style) that its memory depends on, from HF's config.json."""

    name: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False  # Qwen3: an RMSNorm over each head's q and k
    max_position_embeddings: int = 0
    num_experts: int = 0  # mixture of experts (Qwen3-MoE): 0 = dense
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    # a vision-language model's vision tower and connector: parameters, encoder layers, one layer's activations per
    # image token (forge_rl/runtime/vision_memory.py)
    vision_parameters: int = 0
    vision_layers: int = 0
    vision_layer_bytes: int = 0

    @classmethod
    def from_config(cls, config: str | Path | dict, name: str | None = None) -> "ModelShape":
        """From a config.json path (or its directory, or the dict); a missing key is a ValueError naming it. A
        vision-language model's (Idefics3) is its language model's, plus its vision tower's parameters."""
        if not isinstance(config, dict):
            path = Path(config)
            path = path / "config.json" if path.is_dir() else path
            name = name or path.parent.name
            config = json.loads(path.read_text())
        if "vision_config" in config and "text_config" in config:
            text = {"tie_word_embeddings": config.get("tie_word_embeddings", False), **config["text_config"]}
            shape = cls.from_config(text, name or config.get("model_type", "model"))
            return replace(shape, **vision_shape(config))
        need = ("hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size", "num_attention_heads")
        if missing := [k for k in need if k not in config]:
            raise ValueError(f"model config of {name} has no {missing}: no memory plan for it")
        heads = config["num_attention_heads"]
        return cls(
            name=name or config.get("_name_or_path") or config.get("model_type", "model"),
            hidden_size=config["hidden_size"],
            num_hidden_layers=config["num_hidden_layers"],
            intermediate_size=config["intermediate_size"],
            vocab_size=config["vocab_size"],
            num_attention_heads=heads,
            num_key_value_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(config.get("attention_bias", False)),
            qk_norm=str(config.get("model_type", "")).startswith("qwen3"),
            max_position_embeddings=int(config.get("max_position_embeddings") or 0),
            num_experts=int(config.get("num_experts") or config.get("num_local_experts") or 0),
            num_experts_per_tok=int(config.get("num_experts_per_tok") or 0),
            moe_intermediate_size=int(config.get("moe_intermediate_size") or 0),
        )

    def layer_parameters(self, ep: int = 1) -> int:
        """One decoder layer's parameters (of a mixture of experts: with 1/ep of its experts)."""
        h, d, a, k = self.hidden_size, self.head_dim, self.num_attention_heads, self.num_key_value_heads
        attention = h * a * d + 2 * h * k * d + a * d * h + ((a + 2 * k) * d if self.attention_bias else 0)
        mlp = (
            self.expert_parameters() // ep + self.num_experts * h
            if self.num_experts
            else 3 * h * self.intermediate_size
        )
        return attention + mlp + 2 * h + (2 * d if self.qk_norm else 0)

    def expert_parameters(self) -> int:
        """One layer's experts (gate, up and down projections of each): 0 for a dense model."""
        return self.num_experts * 3 * self.hidden_size * self.moe_intermediate_size

    def parameters(self) -> int:
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        decoder = embeddings + self.hidden_size + self.num_hidden_layers * self.layer_parameters()
        return decoder + self.vision_parameters

    def fsdp_unit_bytes(self, tp: int = 1, ep: int = 1) -> int:
        """FSDP2's largest unit made whole on a rank for its forward and backward (its TP shard): the parameters in
        bf16 and their fp32 gradient before the reduce-scatter, of the embedding or head (V x h) or one layer (its
        1/ep of the experts under expert parallelism)."""
        return 6 * max(self.vocab_size * self.hidden_size, self.layer_parameters(ep)) // tp

    def layer_activation_bytes(self) -> int:
        """What one decoder layer keeps for its backward, per token (the module's formula)."""
        h, experts, k = self.hidden_size, self.num_experts, self.num_experts_per_tok
        if not experts:
            return 34 * h
        return 15 * h + 2 * h + 4 * k * h + 8 * k * self.moe_intermediate_size + 8 * experts

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes

    def activation_bytes(
        self, tokens: int, checkpointing: bool, logits: bool, vocab_shards: int = 1, vision_trained: bool = True
    ) -> int:
        """The trainer's activations for `tokens` tokens on one rank of `vocab_shards` TP ranks (the module's
        formula); a vision-language model's tower's too, every token taken for an image token."""
        h, layers, layer = self.hidden_size, self.num_hidden_layers, self.layer_activation_bytes()
        per_token = 2 * h * layers + layer if checkpointing else layer * layers
        per_token += self.vision_layer_bytes * (self.vision_layers if vision_trained else 1)
        return tokens * (per_token // vocab_shards + (self.vocab_size // vocab_shards * 2 if logits else 0))


@dataclass
class MemoryPlan:
    """Per GPU, in GB, for a GPU that one trainer rank and one generator replica (or its 1/t) time-share."""

    model: str
    params: int
    gpu_gb: float
    trainer_ranks: int
    offload_optimizer: bool
    trainer_states_gb: float  # params + grads + Adam (16*P/n), whether or not they stay on the GPU
    trainer_resident_gb: float  # what the trainer keeps on the GPU while the engine generates
    trainer_step_gb: float  # its states during a step (resident + grads brought back), without activations
    activations_gb: float
    engine_weights_gb: float
    kv_bytes_per_token: int
    tensor_parallel_size: int
    gpu_memory_utilization: float
    kv_tokens: int
    min_kv_tokens: int
    min_kv_what: str
    margin_gb: float = MARGIN_GB
    refusal: str = ""
    warnings: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return not self.refusal

    def kv_tokens_at(self, utilization: float) -> int:
        """KV-cache tokens a replica holds when the engine gets `utilization` of each GPU."""
        free = utilization * self.gpu_gb - self.engine_weights_gb - ENGINE_OVERHEAD_GB
        return max(0, int(free * GB * self.tensor_parallel_size // self.kv_bytes_per_token))

    def describe(self) -> str:
        keeps = "fp32 params; Adam and grads on the host" if self.offload_optimizer else "params, grads, Adam"
        line = (
            f"memory plan {self.model} ({self.params / 1e9:.2f}B params) on a {self.gpu_gb:.1f} GB GPU: trainer "
            f"{self.trainer_resident_gb:.1f} GB while generating ({keeps}), {self.trainer_step_gb:.1f} GB states + "
            f"~{self.activations_gb:.1f} GB activations while stepping; engine weights "
            f"{self.engine_weights_gb:.1f} GB, "
            f"gpu_memory_utilization {self.gpu_memory_utilization:.3f} -> {self.kv_tokens:,} KV tokens "
            f"(needs {self.min_kv_tokens:,}: {self.min_kv_what})"
        )
        return "\n".join([line, *self.warnings, *([f"refused: {self.refusal}"] if self.refusal else [])])

    def check(self, user_utilization: float | None = None) -> None:
        """Raise a ConfigError with the numbers when the plan refuses, or when `user_utilization` (the user's
        generator.engine_args.gpu_memory_utilization) leaves the trainer too little or the engine too few tokens."""
        if self.refusal:
            raise ConfigError(self.refusal)
        if user_utilization is None:
            return
        if user_utilization > self.gpu_memory_utilization + 1e-9:
            raise ConfigError(
                f"generator.engine_args.gpu_memory_utilization={user_utilization} gives the engine "
                f"{user_utilization * self.gpu_gb:.1f} GB of the {self.gpu_gb:.1f} GB GPU, but the trainer keeps "
                f"{self.trainer_resident_gb:.1f} GB on it while the engine generates ({self.model}, colocated): "
                "at most "
                f"{self.gpu_memory_utilization:.3f}; lower it or leave it out (the memory plan sets it)"
            )
        if (tokens := self.kv_tokens_at(user_utilization)) < self.min_kv_tokens:
            raise ConfigError(
                f"generator.engine_args.gpu_memory_utilization={user_utilization} leaves {self.model}'s engine "
                f"{tokens:,} KV tokens ({self.engine_weights_gb:.1f} GB of weights on a {self.gpu_gb:.1f} GB GPU); "
                f"it needs {self.min_kv_tokens:,} ({self.min_kv_what}): raise it (at most "
                f"{self.gpu_memory_utilization:.3f}) or leave it out"
            )


def plan_memory(
    shape: ModelShape,
    gpu_bytes: float,
    *,
    trainer_ranks: int = 1,
    micro_batch: int = 1,
    seq_len: int = 2048,
    activation_checkpointing: bool = True,
    fused_lm_head: bool = True,
    trainer_tp: int = 1,
    trainer_ep: int = 1,
    lm_head_memory_gb: float = LM_HEAD_MEMORY_GB,
    offload_optimizer: bool = False,
    lora: bool = False,
    reference_params: int = 0,
    critic_params: int = 0,
    engine_dtype: str = "bfloat16",
    tensor_parallel_size: int = 1,
    max_model_len: int | None = None,
    max_num_seqs: int | None = None,
    margin_gb: float = MARGIN_GB,
    vision_trained: bool = True,
) -> MemoryPlan:
    """The plan of one GPU that a trainer rank (of `trainer_ranks`) and a generator replica's share time-share
    (the module's formulas). Never raises for a plan that does not fit: `plan.refusal` says why, `plan.check()`
    raises it."""
    params, n, t = shape.parameters(), max(trainer_ranks, 1), max(tensor_parallel_size, 1)
    gpu_gb, fp32_gb = gpu_bytes / GB, 4 * params / n / GB
    states = fp32_gb if lora else 4 * fp32_gb
    # while the engine generates: the fp32 params (+ grads and Adam unless offloaded); a step adds the grads back
    resident = fp32_gb if lora or offload_optimizer else states
    step = resident + (fp32_gb if offload_optimizer and not lora else 0.0)
    extra = (4 * reference_params + 16 * critic_params) / n / GB + TRAINER_OVERHEAD_GB
    logits = not fused_lm_head or trainer_tp > 1  # the trainer fuses the lm_head unless TP splits its vocabulary
    head_gb = 0.0 if logits else min(lm_head_memory_gb, micro_batch * seq_len * shape.vocab_size * 10 / GB)
    engine_bytes = DTYPE_BYTES.get(str(engine_dtype).replace("torch.", ""), 2)
    max_len = max_model_len or shape.max_position_embeddings or seq_len
    min_kv, what = (
        (max_len * max_num_seqs, f"max_model_len={max_len} x max_num_seqs={max_num_seqs}")
        if max_num_seqs
        else (max_len, f"one max_model_len={max_len} sequence")
    )
    utilization = math.floor(max(0.0, (gpu_gb - resident - extra - margin_gb) / gpu_gb) * 1000) / 1000
    plan = MemoryPlan(
        model=shape.name,
        params=params,
        gpu_gb=gpu_gb,
        trainer_ranks=n,
        offload_optimizer=offload_optimizer,
        trainer_states_gb=states,
        trainer_resident_gb=resident + extra,
        trainer_step_gb=step + extra,
        activations_gb=(
            shape.activation_bytes(micro_batch * seq_len, activation_checkpointing, logits, trainer_tp, vision_trained)
            + (shape.fsdp_unit_bytes(trainer_tp, trainer_ep) if n // max(trainer_tp, 1) > 1 else 0)
        )
        / GB
        + head_gb,
        engine_weights_gb=params * engine_bytes / t / GB,
        kv_bytes_per_token=shape.kv_bytes_per_token(engine_bytes),
        tensor_parallel_size=t,
        gpu_memory_utilization=utilization,
        kv_tokens=0,
        min_kv_tokens=min_kv,
        min_kv_what=what,
        margin_gb=margin_gb,
    )
    plan.kv_tokens = plan.kv_tokens_at(utilization)
    plan.refusal = _refusal(plan, lora)
    if plan.trainer_step_gb + plan.activations_gb + margin_gb > gpu_gb and not plan.refusal:
        plan.warnings.append(
            f"warning: the trainer's step may not fit: {plan.trainer_step_gb:.1f} GB states + "
            f"~{plan.activations_gb:.1f} "
            f"GB activations ({micro_batch} x {seq_len} tokens per micro-batch, activation checkpointing "
            f"{'on' if activation_checkpointing else 'off'}) + {margin_gb:.1f} GB margin > {gpu_gb:.1f} GB; lower "
            "trainer.micro_batch_size or set trainer.parallel.activation_checkpointing: true"
        )
    return plan


def _refusal(plan: MemoryPlan, lora: bool) -> str:
    """Why the plan cannot work, with its numbers and the keys to change; "" when it can."""
    head = f"{plan.model} ({plan.params / 1e9:.2f}B params) colocated on a {plan.gpu_gb:.1f} GB GPU"
    fp32 = 4 * plan.params / plan.trainer_ranks / GB
    if plan.trainer_step_gb + plan.margin_gb > plan.gpu_gb:
        parts = (
            f"fp32 params {fp32:.1f} GB (LoRA: frozen)"
            if lora
            else f"fp32 params {fp32:.1f} + grads {fp32:.1f}"
            + ("" if plan.offload_optimizer else f" + Adam {2 * fp32:.1f}")
            + " GB"
        )
        return (
            f"{head}: the trainer's states take {plan.trainer_step_gb:.1f} GB per GPU during a step ({parts} over "
            f"{plan.trainer_ranks} rank(s), CUDA context and any reference policy included) + {plan.margin_gb:.1f} GB "
            f"margin > {plan.gpu_gb:.1f} GB; raise trainer_procs (FSDP shards the states over more GPUs), "
            "use trainer.lora, or resources.placement: disaggregated on more GPUs"
        )
    if plan.kv_tokens < plan.min_kv_tokens:
        kv = plan.kv_bytes_per_token
        return (
            f"{head}: the trainer keeps {plan.trainer_resident_gb:.1f} GB while the engine generates, which leaves "
            f"the engine gpu_memory_utilization {plan.gpu_memory_utilization:.3f} "
            f"({plan.gpu_memory_utilization * plan.gpu_gb:.1f} GB) for its weights {plan.engine_weights_gb:.1f} GB + "
            f"{ENGINE_OVERHEAD_GB:.1f} GB overhead + a KV cache of {plan.kv_tokens:,} tokens ({kv / 1024:.0f} "
            "KiB each), "
            f"fewer than the {plan.min_kv_tokens:,} it needs ({plan.min_kv_what}: "
            f"{plan.min_kv_tokens * kv / GB / plan.tensor_parallel_size:.1f} GB per GPU); lower "
            "generator.engine_args.max_model_len or generator.engine_args.max_num_seqs, "
            + "raise generator.engine_args.tensor_parallel_size, or use resources.placement: disaggregated"
        )
    return ""


def size_one_gpu(shape: ModelShape, gpu_bytes: float, **kwargs) -> tuple[str, MemoryPlan]:
    """("fits" | "needs optimizer offload (not built)" | "refused", the plan): as forge_rl trains, then as it
    would with Adam and the grads on the host (a sizing what-if: the trainer keeps them on the GPU today; the
    plan returned when neither fits says why in its refusal)."""
    plan = plan_memory(shape, gpu_bytes, **{**kwargs, "offload_optimizer": False})
    if plan.fits:
        return "fits", plan
    offloaded = plan_memory(shape, gpu_bytes, **{**kwargs, "offload_optimizer": True})
    return ("needs optimizer offload (not built)" if offloaded.fits else "refused"), offloaded


def table(shapes: list[ModelShape], gpu_bytes: float, **kwargs) -> str:
    """A markdown table of `size_one_gpu` for each shape."""
    rows = [
        "| model | params | trainer GB (generating / stepping + activations) | engine weights GB | "
        "gpu_memory_utilization | KV tokens | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for shape in shapes:
        verdict, p = size_one_gpu(shape, gpu_bytes, **kwargs)
        rows.append(
            f"| {p.model} | {p.params / 1e9:.3f}B | {p.trainer_resident_gb:.1f} / {p.trainer_step_gb:.1f} + "
            f"{p.activations_gb:.1f} | {p.engine_weights_gb:.1f} | {p.gpu_memory_utilization:.3f} | "
            f"{p.kv_tokens:,} | {verdict} |"
        )
    return "\n".join(rows)


def gpu_total_bytes(gpu: str) -> int:
    """Memory of the GPU that CUDA_VISIBLE_DEVICES names `gpu`: nvidia-smi's figure, which keeps the controller
    free of a CUDA context (one would hold memory of a colocated GPU for the whole run); else
    torch.cuda.get_device_properties(0).total_memory. Call it only on CUDA hosts."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", gpu],
            capture_output=True,
            text=True,
            timeout=30,
        )
        return int(float(out.stdout.split()[0]) * 2**20)  # MiB
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        import torch

        return torch.cuda.get_device_properties(0).total_memory


_QWEN3 = dict(vocab_size=151936, num_key_value_heads=8, head_dim=128, model_type="qwen3", max_position_embeddings=40960)
# Published Qwen3 shapes, for the table without config files at hand (`--model-config` reads real ones).
QWEN3_SHAPES = {
    "Qwen3-0.6B": dict(
        _QWEN3,
        hidden_size=1024,
        num_hidden_layers=28,
        intermediate_size=3072,
        num_attention_heads=16,
        tie_word_embeddings=True,
    ),
    "Qwen3-1.7B": dict(
        _QWEN3,
        hidden_size=2048,
        num_hidden_layers=28,
        intermediate_size=6144,
        num_attention_heads=16,
        tie_word_embeddings=True,
    ),
    "Qwen3-8B": dict(
        _QWEN3,
        hidden_size=4096,
        num_hidden_layers=36,
        intermediate_size=12288,
        num_attention_heads=32,
        tie_word_embeddings=False,
    ),
    "Qwen3-32B": dict(
        _QWEN3,
        hidden_size=5120,
        num_hidden_layers=64,
        intermediate_size=25600,
        num_attention_heads=64,
        tie_word_embeddings=False,
    ),
    "Qwen3-30B-A3B": dict(
        _QWEN3,
        model_type="qwen3_moe",
        hidden_size=2048,
        num_hidden_layers=48,
        intermediate_size=6144,
        num_attention_heads=32,
        num_key_value_heads=4,
        tie_word_embeddings=False,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
    ),
}


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(
        prog="python -m forge_rl.runtime.memory_plan",
        description="One GPU shared by the trainer and a vLLM engine: the memory plan.",
    )
    p.add_argument(
        "--model-config",
        action="append",
        default=[],
        help="an HF config.json (or its directory); repeatable; none: Qwen3 0.6B, 1.7B, 8B, 32B and 30B-A3B",
    )
    p.add_argument("--gpu-gb", type=float, default=80.0, help="GPU memory in GB (1e9 bytes)")
    p.add_argument("--trainer-ranks", type=int, default=1)
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per forward/backward on a rank")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--no-activation-checkpointing", action="store_true")
    args = p.parse_args(argv)
    shapes = [ModelShape.from_config(c) for c in args.model_config] or [
        ModelShape.from_config(cfg, name) for name, cfg in QWEN3_SHAPES.items()
    ]
    kwargs = dict(
        trainer_ranks=args.trainer_ranks,
        micro_batch=args.micro_batch,
        seq_len=args.seq_len,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        tensor_parallel_size=args.tensor_parallel_size,
        activation_checkpointing=not args.no_activation_checkpointing,
    )
    out = table(shapes, args.gpu_gb * GB, **kwargs)
    print(out)
    for shape in shapes:
        print(size_one_gpu(shape, args.gpu_gb * GB, **kwargs)[1].describe())
    return out


if __name__ == "__main__":
    main()
