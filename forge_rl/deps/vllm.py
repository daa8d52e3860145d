"""vLLM 0.32 names forge_rl uses beyond `vllm`'s top-level exports. Imported on demand (vLLM is heavy).

- `AsyncLLM` (vllm.v1.engine.async_llm): the V1 async engine; `vllm.AsyncLLMEngine` is an alias of it in
  0.32, kept for the V0 API's name; forge_rl calls V1 methods (pause_generation, reload via collective_rpc,
  update_weight_version), so it names the V1 class.
- `EngineDeadError` (vllm.v1.engine.exceptions): what a request raises when the EngineCore process died.
- `UsageContext` (vllm.usage.usage_lib): needed to build an engine config before the engine
  (`AsyncEngineArgs.create_engine_config`), which forge_rl does to choose the EngineCore's start method.
- `MoEWeightReload` (a worker extension, `worker_extension_cls`): vLLM 0.32's in-place reload leaves a CPU
  mixture-of-experts layer's expert weights in checkpoint layout: on a weight update `UnquantizedFusedMoEMethod`
  skips `fused_experts.process_weights_after_loading`, which on CPU prepacks them for `cpu_fused_moe`, so the
  reloaded experts compute garbage (even reloading the very same weights changes the logprobs). Its
  `forge_rl_reload_weights` reloads, then runs that step for each CPU expert layer (`CPUUnquantizedExperts`).
- `WorkerExtension`: what a CPU generator's workers get, the reload above and Keep Routing's route recorder
  (forge_rl/deps/vllm_routes.py).
- `openai_protocol()`: vLLM's pydantic models of the OpenAI API (vllm.entrypoints.openai.*.protocol and
  vllm.entrypoints.serve.engine.protocol), which the agents' endpoint (forge_rl/agents/server.py) serves, so that
  forge_rl never writes the OpenAI schema itself; `hermes_tool_parser()`: the parser vLLM ships for Hermes-style
  tool calls (`<tool_call>{...}</tool_call>`, Qwen3's), vllm.tool_parsers.hermes_tool_parser.
"""

from types import SimpleNamespace

from forge_rl.deps.vllm_routes import RouteRecorder

WORKER_EXTENSION = "forge_rl.deps.vllm_worker.WorkerExtension"  # its module installs CPU LoRA ops


class MoEWeightReload:
    """Mixed into vLLM's CPU worker (worker_extension_cls): `reload_weights`, then the CPU experts' prepacking
    that a weight update skips. Returns the number of expert layers prepacked (0 for a dense model)."""

    def forge_rl_reload_weights(self, weights_path: str) -> int:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

        self.reload_weights(weights_path=weights_path)
        fixed = 0
        for module in self.model_runner.get_model().modules():
            kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
            experts = getattr(kernel, "fused_experts", None)
            if isinstance(experts, CPUUnquantizedExperts):
                experts.process_weights_after_loading(module)
                fixed += 1
        return fixed


class WorkerExtension(MoEWeightReload, RouteRecorder):
    """forge_rl's methods on vLLM's worker: MoE reloads and route recording."""


def async_llm():
    from vllm.v1.engine.async_llm import AsyncLLM

    return AsyncLLM


def engine_dead_error() -> type[Exception]:
    from vllm.v1.engine.exceptions import EngineDeadError

    return EngineDeadError


def openai_protocol() -> SimpleNamespace:
    """vLLM's OpenAI request and response models: chat completions, completions, models, errors and usage."""
    from vllm.entrypoints.openai.chat_completion import protocol as chat
    from vllm.entrypoints.openai.completion import protocol as completion
    from vllm.entrypoints.serve.engine import protocol as serve
    from vllm.entrypoints.generate.base.protocol import FunctionCall, ToolCall

    return SimpleNamespace(
        ChatCompletionRequest=chat.ChatCompletionRequest,
        ChatCompletionResponse=chat.ChatCompletionResponse,
        ChatCompletionResponseChoice=chat.ChatCompletionResponseChoice,
        ChatMessage=chat.ChatMessage,
        ChatCompletionLogProbs=chat.ChatCompletionLogProbs,
        ChatCompletionLogProbsContent=chat.ChatCompletionLogProbsContent,
        CompletionRequest=completion.CompletionRequest,
        CompletionResponse=completion.CompletionResponse,
        CompletionResponseChoice=completion.CompletionResponseChoice,
        CompletionLogProbs=completion.CompletionLogProbs,
        ModelCard=serve.ModelCard,
        ModelList=serve.ModelList,
        ErrorInfo=serve.ErrorInfo,
        ErrorResponse=serve.ErrorResponse,
        UsageInfo=serve.UsageInfo,
        ToolCall=ToolCall,
        FunctionCall=FunctionCall,
    )


def hermes_tool_parser() -> type:
    """vLLM's parser of Hermes-style tool calls (Qwen3's format); made with a tokenizer, it turns a reply's text
    into OpenAI tool calls (`extract_tool_calls(text, request)`)."""
    from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser

    return Hermes2ProToolParser


def engine_context():
    from vllm.usage.usage_lib import UsageContext

    return UsageContext.ENGINE_CONTEXT


# Engine arguments the configs and docs use, known to be AsyncEngineArgs fields (tests/unit/deps/test_deps.py
# checks them):
# a config that uses only these is checked without importing vLLM (a slow import); any other name is
# looked up among AsyncEngineArgs' fields.
COMMON_ENGINE_ARGS = frozenset(
    {
        "max_model_len",
        "dtype",
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "gpu_memory_utilization",
        "logprobs_mode",
        "enforce_eager",
        "max_num_seqs",
        "max_num_batched_tokens",
        "enable_sleep_mode",
        "distributed_executor_backend",
        "enable_prefix_caching",
        "enable_chunked_prefill",
        "kv_cache_dtype",
        "quantization",
        "seed",
        "trust_remote_code",
        "enable_lora",
        "max_lora_rank",
        "max_loras",
        "block_size",
        "cpu_offload_gb",
        "enable_return_routed_experts",
    }
)


# Engine arguments forge_rl itself reads as numbers (prompt room, placement): checked here, whatever vLLM says later.
POSITIVE_INT_ENGINE_ARGS = (
    "max_model_len",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "max_num_seqs",
    "max_num_batched_tokens",
)


def engine_arg_names() -> frozenset[str]:
    """Every keyword AsyncEngineArgs takes. vLLM's import-time warnings (no Triton CPU backend, before its logging is
    configured) are not shown: they would add lines to a run's one-line error."""
    import dataclasses
    import logging

    logging.disable(logging.WARNING)
    try:
        from vllm.engine.arg_utils import AsyncEngineArgs
    finally:
        logging.disable(logging.NOTSET)
    return frozenset(f.name for f in dataclasses.fields(AsyncEngineArgs))


def check_engine_args(engine_args: dict, key: str) -> None:
    """A name in `engine_args` (the config key `key`) that vLLM's engine does not take fails here, before any
    engine starts, naming the closest ones."""
    from forge_rl.errors import ConfigError, did_you_mean

    for name in POSITIVE_INT_ENGINE_ARGS:
        value = engine_args.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"{key}.{name}={value!r}: give an integer >= 1")
    utilization = engine_args.get("gpu_memory_utilization")
    if utilization is not None and (
        isinstance(utilization, bool) or not isinstance(utilization, (int, float)) or not 0 < utilization <= 1
    ):
        raise ConfigError(
            f"{key}.gpu_memory_utilization={utilization!r}: give the fraction of the GPU's memory "
            "for the engine, in (0, 1]"
        )
    unknown = sorted(set(engine_args) - COMMON_ENGINE_ARGS)
    if not unknown:
        return
    names = engine_arg_names()
    for name in unknown:
        if name not in names:
            hint = did_you_mean(name, names) or "see vLLM's engine arguments (vllm serve --help)"
            raise ConfigError(f"{key}.{name} is not a vLLM engine argument; {hint}")
