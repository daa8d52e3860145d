"""What vLLM's CPU worker process imports as forge_rl's worker extension (`worker_extension_cls`): the extension's
methods (forge_rl/deps/vllm.py), and LoRA ops grouped by adapter in place of vLLM's per-token ones
(forge_rl/deps/vllm_cpu_lora.py), installed as the worker imports this module, before it builds its model."""

from forge_rl.deps.vllm import WorkerExtension
from forge_rl.deps.vllm_cpu_lora import install

install()

__all__ = ["WorkerExtension"]
