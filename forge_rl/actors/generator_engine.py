"""How a Generator's vLLM engine is configured, started and watched: the CPU defaults, the arguments Keep Routing and
LoRA need, seeded requests on a CPU (no chunked prefill), where the model runs on a CPU (in the EngineCore or a
Worker), vLLM's compiled helpers run eagerly on an eager CPU engine, how the EngineCore process starts (fork on CPU,
spawn on CUDA), vLLM's refusals of the engine arguments as one line naming the config key, Keep Routing's recorder
started, and a dead engine ending its proc.
"""

import asyncio
import contextlib
import os
import signal
import sys
from typing import Any

import torch

from forge_rl.deps.vllm import WORKER_EXTENSION, async_llm, engine_context
from forge_rl.errors import ConfigError

ENGINE_CHECK_S = 1.0  # how often an idle generator checks that its vLLM engine is alive

CPU_ENGINE_DEFAULTS: dict[str, Any] = dict(
    dtype="float32", enforce_eager=True, kv_cache_memory_bytes=256 << 20, max_model_len=512
)
# Behaviour logprobs after temperature scaling: the policy the trainer trains is softmax(logits / T).
ENGINE_DEFAULTS: dict[str, Any] = dict(logprobs_mode="processed_logprobs", use_tqdm_on_load=False)

# vLLM's own step token budget of an engine (SchedulerConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS)
DEFAULT_BATCHED_TOKENS = 2048

# vLLM's accepted max_lora_rank values; an adapter of rank r needs the smallest one >= r.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def route_engine_args(cuda: bool, engine_args: dict[str, Any], key: str) -> dict[str, Any]:
    """Engine arguments under which the engine records every position's experts (Keep Routing). A GPU engine
    returns them itself (vLLM's `enable_return_routed_experts`, Model Runner V2). On CPU forge_rl's recorder sees
    only the positions a request runs, so prefix caching is off: a cached prompt prefix would have no record (each
    completion of a group then computes its prompt; the prompt is short next to a group's responses)."""
    if cuda:
        return dict(enable_return_routed_experts=True)
    if engine_args.get("worker_extension_cls", WORKER_EXTENSION) != WORKER_EXTENSION:
        raise ConfigError(
            f"{key}.worker_extension_cls={engine_args['worker_extension_cls']!r} with "
            f"trainer.keep_routing: a CPU engine records routes through {WORKER_EXTENSION}; remove it"
        )
    if engine_args.get("enable_prefix_caching"):
        raise ConfigError(
            f"{key}.enable_prefix_caching=true with trainer.keep_routing: a CPU engine records the "
            "experts of the positions a request computes, and a cached prefix is not computed; remove it"
        )
    return dict(enable_prefix_caching=False)


def unchunked_prefill(args: dict[str, Any], key: str) -> dict[str, Any]:
    """A CPU engine that takes seeded requests (a run's rollouts carry per-request seeds: forge_rl/data/seeds.py)
    must not split a prompt over engine steps. vLLM 0.32 draws a token for a request whose prompt is
    only partly computed, throws it away, and rewinds the request's random generator (`set_offset(offset - 4)`, a
    CUDA Philox generator's API); a CPU generator has no offset, so the EngineCore dies ("CPU Generator does not
    use offset") as soon as continuous batching splits a seeded prompt. Without chunked prefill a prompt is computed
    whole in one step, so no draw is thrown away; the step's token budget is raised to max_model_len if below it
    (vLLM refuses an unchunked engine whose budget is smaller). An explicit `enable_chunked_prefill: true` is
    refused: every seeded request could end the engine."""
    if args.get("enable_chunked_prefill"):
        raise ConfigError(
            f"{key}.enable_chunked_prefill=true on a CPU engine: vLLM 0.32 crashes on a seeded request whose prompt "
            "is split over engine steps (a run's rollouts are seeded from its `seed`); remove it"
        )
    budget = max(args.get("max_num_batched_tokens") or DEFAULT_BATCHED_TOKENS, args.get("max_model_len") or 0)
    return {**args, "enable_chunked_prefill": False, "max_num_batched_tokens": budget}


def cpu_engine_env(args: dict[str, Any]) -> dict[str, Any]:
    """A CPU engine of one rank pinned to one core runs its model in the EngineCore process ("uni"
    executor). vLLM's CPU platform turns "uni" into "mp" (a Worker process of its own, fed over a
    shared-memory queue) unless V1 multiprocessing is off; AsyncLLM keeps its EngineCore process either way, so
    turning it off here only removes the Worker: on one pinned core the engine starts sooner (one process fewer)
    and makes more groups/s (no queue between two processes that share the core). With more than one core
    (colocated, or unpinned) the Worker is kept: the scheduler and the model then run on different cores, which
    is faster there. An explicit `distributed_executor_backend` is left alone."""
    if args.get("tensor_parallel_size", 1) * args.get("pipeline_parallel_size", 1) != 1:
        return args
    if len(os.sched_getaffinity(0)) != 1:
        return args
    if args.get("distributed_executor_backend", "uni") != "uni":
        return args
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # read by vLLM's CPU platform when the engine is made
    return {**args, "distributed_executor_backend": "uni"}


def eager_helpers(args: dict[str, Any]) -> None:
    """An eager CPU engine (enforce_eager, the CPU default) runs vLLM's torch.compile'd helpers eagerly as well.
    vLLM compiles a few sampler helpers whatever enforce_eager says (the sampled token's rank among the logprobs,
    top-k/top-p masks); on a CPU that is Inductor generating and building C++ during the engine's first step, for
    ops that are a comparison and a sum. The stance is set in this proc, and the EngineCore forked from it
    (engine_start_method) inherits it; an engine started by spawn still compiles them. An engine asked to compile
    (enforce_eager=false) keeps torch.compile."""
    if args.get("enforce_eager"):
        torch.compiler.set_stance("force_eager")


def cuda_visible() -> bool:
    """Whether this proc has a GPU, asked without initialising CUDA: NVML answers, so a process forked from
    this one later (vLLM's EngineCore) can still use CUDA."""
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # read by torch.cuda.is_available() at each call
    return torch.cuda.is_available()


def engine_start_method(cuda: bool, environ: dict | None = None) -> str | None:
    """How vLLM's EngineCore process starts: None keeps a VLLM_WORKER_MULTIPROC_METHOD the user (or an earlier
    engine of this process) set; "spawn" on CUDA, where a forked child of a process that has touched CUDA
    fails ("Cannot re-initialize CUDA in forked subprocess") and vLLM's own check only sees torch's lazy
    init; "fork" on CPU, where there is no CUDA context to break and a spawned process imports vLLM and torch again."""
    environ = os.environ if environ is None else environ
    if "VLLM_WORKER_MULTIPROC_METHOD" in environ:
        return None
    return "spawn" if cuda else "fork"


@contextlib.contextmanager
def engine_args_refused(engine_args: dict, key: str):
    """vLLM's validation of the engine config (pydantic: a value of the wrong type or out of range, a max_model_len
    beyond the model's) as a ConfigError naming the user's `key`.<arg> where vLLM names one of them."""
    from pydantic import ValidationError

    try:
        yield
    except ValidationError as e:
        why: dict[str | None, str] = {}  # the first of each argument's errors (a union type gives one per member)
        for error in e.errors():
            name = next((str(part) for part in reversed(error.get("loc", ())) if str(part) in engine_args), None)
            text = error.get("msg", "").removeprefix("Value error, ").split(". ")[0]
            why.setdefault(name, f"{key}.{name}={engine_args[name]!r}: {text}" if name else f"{key}: {text}")
        raise ConfigError(f"vLLM refuses the engine arguments: {'; '.join(why.values())}") from None


def start_engine(engine_args, start_method: str | None):
    """The AsyncLLM of `engine_args`, its EngineCore process started by `start_method`
    (engine_start_method: fork on CPU, spawn on CUDA, None = vLLM's choice).

    vLLM's CPU platform always spawns the EngineCore (it sets VLLM_WORKER_MULTIPROC_METHOD=spawn while it
    builds the config), and a spawned process imports vLLM and torch again, most of an engine's start on a CPU;
    forked, it skips those imports and starts sooner. On CPU there is no CUDA context for a
    fork to break, and vLLM's CPU worker sets its OpenMP threads up after it starts. GPUs keep vLLM's choice,
    and so does a VLLM_WORKER_MULTIPROC_METHOD already in the environment (set by the user, or by a previous
    engine of this process: a second engine in one process is spawned; a generator proc holds one).

    The shared memory the engine makes (its executor's broadcast queue) is registered with Python's resource
    tracker, which unlinks it when the engine is killed without cleaning up (as its shutdown ends). Started
    here first, the tracker is this proc's child and the forked EngineCore reuses it; otherwise the
    EngineCore would start its own, and vLLM's shutdown kills the EngineCore's children with it."""
    from multiprocessing import resource_tracker

    config = engine_args.create_engine_config(engine_context())
    if start_method is not None:  # after the config: vLLM's CPU platform sets "spawn" while it builds it
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = start_method  # read when the EngineCore process starts
    if start_method == "fork":
        resource_tracker.ensure_running()
    return async_llm().from_vllm_config(
        config, disable_log_stats=engine_args.disable_log_stats, enable_log_requests=engine_args.enable_log_requests
    )


def lora_engine_args(rank: int) -> dict[str, Any]:
    """vLLM engine arguments to serve LoRA adapters of `rank`: up to three adapters in one batch (the
    current version and requests still finishing on older ones), four cached."""
    fits = [r for r in VLLM_LORA_RANKS if r >= rank]
    if not fits:
        raise ValueError(f"trainer.lora.rank={rank}: vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}")
    return dict(enable_lora=True, max_lora_rank=fits[0], max_loras=3, max_cpu_loras=4)


async def start_recording_routes(engine, cuda: bool, model: str) -> torch.dtype:
    """Keep Routing: vLLM's own routed experts on a GPU engine (enable_return_routed_experts, Model Runner V2),
    forge_rl's recorder in the worker otherwise (forge_rl/deps/vllm_routes.py); the same record either way. Returns
    the dtype of the recorded expert ids."""
    config = engine.vllm_config.model_config
    dtype = torch.uint8 if config.get_num_experts() <= 256 else torch.int16
    if not cuda:
        layers, top_k = (await engine.collective_rpc("forge_rl_record_routes"))[0]
        if not layers:
            raise ConfigError(
                f"trainer.keep_routing: {model} has no mixture-of-experts layer in vLLM's "
                "model, so there are no routes to keep; set trainer.keep_routing=false"
            )
    return dtype


async def watch_engine(owner) -> None:
    """End this proc when `owner.engine` (a Generator's) has errored; returns once the owner drops its engine."""
    while owner.engine is not None:
        if owner.engine.errored:
            engine_died()
        await asyncio.sleep(ENGINE_CHECK_S)


def engine_died() -> None:
    """A dead EngineCore cannot be revived in place. End this proc: a Service then replaces the
    replica and retries the calls that were in flight on it (the reaper clears what the engine
    left); an actor's owner gets a SupervisionError on its next call."""
    print(
        f"generator pid {os.getpid()}: the vLLM engine died; ending this proc so that it is replaced",
        file=sys.stderr,
        flush=True,
    )
    os.kill(os.getpid(), signal.SIGKILL)
