"""The Tinker-compatible service's configuration (`configs/tinker/*.yaml`): the base model it serves, the port and
key, the LoRA rank it trains (0: full fine-tuning), the limits a request is checked against, and the trainer's and
the generator's settings. Torch-free, so a config is checked before any actor starts."""

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from forge_rl.runtime.placement import ResourcesConfig
from forge_rl.tinker.errors import Refused


@dataclass
class TinkerConfig:
    # the one base model every training and sampling client uses: an embedded model's name or a local HF directory;
    # clients name it by this string (base_model="tiny") or by its local directory (a tokenizer loads from it offline)
    model: str = "tiny"
    host: str = "127.0.0.1"
    port: int = 0  # 0: a free port, printed at start
    # the key clients pass (api_key=...). Empty: a new one per run, printed at start. The client requires "tml-"
    api_key: str = ""
    # keys of that many more users (printed, and in output_dir/service.json), each seeing only its own clients
    extra_users: int = 0
    # LoRA rank of every training client's adapters (the client's rank must equal it); 0: full fine-tuning
    lora_rank: int = 8
    lora_alpha: float = 16.0
    max_training_clients: int = 4  # under LoRA all share one trainer; with every weight trained each has its own
    # LoRA: each training client's newest saves the generator keeps servable; a sampling client of an older save is
    # stale. A loop that samples while it trains (tinker-cookbook's async mode) samples saves a step or more behind
    kept_saves: int = 4
    max_batch_datums: int = 256  # datums in one forward_backward
    max_sequence_tokens: int = 256  # tokens of one datum, and a sample's prompt plus max_tokens
    max_samples: int = 64  # num_samples of one sample call
    trainer_procs: int = 1
    trainer_dtype: str = "float32"
    max_grad_norm: float = 0.0  # the server's clip when the client's grad_clip_norm is 0; 0: none
    seed: int = 0
    # cores of the generator and of the trainers on a CPU machine, as forge_rl's runs place them (auto: apart when
    # the machine has a core for each; forge_rl/runtime/placement.py); the trainers of all clients share theirs
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    # vLLM engine arguments of the generator (max_model_len follows max_sequence_tokens unless set)
    engine_args: dict[str, Any] = field(default_factory=dict)
    output_dir: str = "outputs/tinker"  # checkpoints (save_state) and the service's logs

    def __post_init__(self) -> None:
        if self.api_key and not self.api_key.startswith("tml-"):
            raise ValueError("api_key must start with 'tml-' (the tinker client refuses any other key)")
        if self.lora_rank < 0:
            raise ValueError(f"lora_rank must be >= 0 (0: full fine-tuning), got {self.lora_rank}")
        if self.extra_users < 0:
            raise ValueError(f"extra_users must be >= 0, got {self.extra_users}")
        for name in ("max_training_clients", "kept_saves", "max_batch_datums", "max_sequence_tokens", "max_samples"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")

    def check_base_model(self, base_model: str | None, model_dir: str) -> None:
        """Refuse a client's base_model unless it names the served model: by this config's name or by its local
        directory (what tinker-cookbook's recipes pass, as they load the tokenizer by the same name)."""
        if base_model == self.model or (base_model and Path(base_model).resolve() == Path(model_dir).resolve()):
            return
        served = f"this server serves {self.model!r} ({model_dir}); pass that name or path"
        raise Refused(f"unknown base model {base_model!r}: {served}")
