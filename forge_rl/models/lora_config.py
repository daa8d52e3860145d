"""LoRA's settings (`trainer.lora`): the adapters' rank, alpha, dropout and target modules, checked when the config
is made, and written as PEFT's adapter_config.json. How the adapters are built, trained and exported is in
forge_rl/models/lora.py; this module imports no torch, so a run's config is read and checked before any actor starts.
"""

from dataclasses import dataclass, field

# HF/PEFT module name -> the last segment of TorchTitan's Qwen3 module FQN (what LoRAConverter matches)
TITAN_NAME = {
    "q_proj": "wqkv",
    "k_proj": "wqkv",
    "v_proj": "wqkv",
    "o_proj": "wo",
    "gate_proj": "w1",
    "up_proj": "w3",
    "down_proj": "w2",
}
QKV = ("q_proj", "k_proj", "v_proj")
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class LoRAConfig:
    rank: int = 0  # 0 = train every weight (no LoRA)
    alpha: float = 16.0  # the adapter's output is scaled by alpha / rank
    dropout: float = 0.0  # on the adapter's input, training forwards only
    targets: list[str] = field(default_factory=lambda: list(ALL_TARGETS))  # HF module names

    def __post_init__(self) -> None:
        self.targets = list(self.targets)  # OmegaConf hands a ListConfig
        if self.rank < 0:
            raise ValueError(f"trainer.lora.rank must be >= 0 (0 = no LoRA), got {self.rank}")
        if not self.rank:
            return
        if self.rank > 512:
            raise ValueError(f"trainer.lora.rank={self.rank}: vLLM serves LoRA ranks up to 512")
        if self.alpha <= 0:
            raise ValueError(f"trainer.lora.alpha must be > 0, got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"trainer.lora.dropout must be in [0, 1), got {self.dropout}")
        if not self.targets:
            raise ValueError(f"trainer.lora.targets is empty; choose from {ALL_TARGETS}")
        if unknown := [t for t in self.targets if t not in TITAN_NAME]:
            raise ValueError(f"trainer.lora.targets: {unknown} are not Qwen3 linears; choose from {ALL_TARGETS}")
        qkv = [t for t in QKV if t in self.targets]
        if qkv and len(qkv) != 3:
            raise ValueError(
                f"trainer.lora.targets has {qkv} without the rest of q_proj, k_proj, v_proj: the trainer "
                "fuses the three into one linear (wqkv), so they take an adapter together or not at all"
            )

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    def peft_config(self, base_model: str) -> dict:
        """adapter_config.json as PEFT writes it (vLLM's LoRA loader and `peft` read it)."""
        return dict(
            peft_type="LORA",
            task_type="CAUSAL_LM",
            r=self.rank,
            lora_alpha=self.alpha,
            lora_dropout=self.dropout,
            target_modules=sorted(set(self.targets)),
            bias="none",
            fan_in_fan_out=False,
            use_rslora=False,
            base_model_name_or_path=str(base_model),
        )
