"""vLLM 0.32 names forge_rl uses beyond `vllm`'s top-level exports. Imported on demand (vLLM is heavy).

- `AsyncLLM` (vllm.v1.engine.async_llm): the V1 async engine; `vllm.AsyncLLMEngine` is an alias of it in
  0.32, kept for the V0 API's name; forge_rl calls V1 methods (pause_generation, reload via collective_rpc,
  update_weight_version), so it names the V1 class.
- `EngineDeadError` (vllm.v1.engine.exceptions): what a request raises when the EngineCore process died.
- `UsageContext` (vllm.usage.usage_lib): needed to build an engine config before the engine
  (`AsyncEngineArgs.create_engine_config`), which forge_rl does to choose the EngineCore's start method.
"""


def async_llm():
    from vllm.v1.engine.async_llm import AsyncLLM

    return AsyncLLM


def engine_dead_error() -> type[Exception]:
    from vllm.v1.engine.exceptions import EngineDeadError

    return EngineDeadError


def engine_context():
    from vllm.usage.usage_lib import UsageContext

    return UsageContext.ENGINE_CONTEXT
