"""A Generator's weights: loading a version the trainer published while requests keep streaming (`update_weights`),
LoRA adapters in place of whole weights, and holding the engine for another role (`hold`, `release`). A mixin of
Generator (forge_rl/actors/generator.py), which declares these endpoints and the swap modes.

An update prefetches the version into this host's shared memory while the engine generates, then swaps between two
engine steps: the engine pauses, reloads from the store, labels the steps after it with the new version and
resumes. In LoRA mode nothing pauses: the version is a new adapter, and a request runs to its end on the adapter it
started with. Updates, holds and releases take one lock, so a swap never meets a held engine.
"""

import asyncio
import json
import os
import shutil
import time
from typing import Any

import torch

from forge_rl.weights.runs import RUN_ID_ENV, SHM_DIR, run_prefix
from forge_rl.weights.shm import FILE, version_dir


class GeneratorWeights:
    """Generator's weights half: needs self.engine, store, lora, model, image_token, reload_method, policy_version,
    _in_flight, _abort_too_old, _tick and _held_s (forge_rl/actors/generator_stats.py)."""

    def _init_weights(self) -> None:
        self._swap_lock: asyncio.Lock | None = None
        self.updates: list[dict] = []  # one record per weight update
        self._held_since: float | None = None  # paused by hold() (colocated placement)
        self._adapters: dict[int, Any] = {}  # version -> its vLLM LoRARequest (LoRA mode)
        self._adapter_users: dict[int, int] = {}  # version -> requests in flight on it
        self._kept_adapters: set[int] = set()  # older versions kept loaded (keep_adapters)

    async def _update_weights(self, version: int, mode: str) -> dict[str, float]:
        """update_weights' work, `mode` checked: prefetch, then swap between two engine steps (or add the adapter)."""
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
                return dict(
                    version=version,
                    mode="already_loaded",
                    prefetch_s=prefetched - start,
                    drain_wait_s=0.0,
                    pause_s=0.0,
                    requests_in_flight=0,
                    tokens_in_flight=0,
                )
            if self.lora is not None:  # no pause: requests in flight finish on their adapter, new ones take this one
                return await self._add_adapter(version, prefetched - start)
            mode = self._image_safe_mode(mode)
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
            version=version,
            mode=mode,
            prefetch_s=prefetched - start,
            # drain: the wait for in-flight requests is time the engine ran below capacity
            drain_wait_s=paused - prefetched if mode == "drain" else 0.0,
            pause_s=done - paused,
            requests_in_flight=requests,
            tokens_in_flight=tokens,
        )
        self.updates.append(record)
        return record

    async def _add_adapter(self, version: int, prefetch_s: float) -> dict[str, float]:
        """LoRA: version's adapter loaded beside the ones requests in flight use; the engine never pauses."""
        loading = time.perf_counter()
        await self._load(version)
        self._abort_too_old()
        record = dict(
            version=version,
            mode="adapter",
            prefetch_s=prefetch_s,
            drain_wait_s=0.0,
            pause_s=0.0,
            adapter_load_s=time.perf_counter() - loading,
            requests_in_flight=sum(len(c) for _, c in self._in_flight.values()),
            tokens_in_flight=0,
        )
        self.updates.append(record)
        return record

    def _image_safe_mode(self, mode: str) -> str:
        """The swap mode a vision-language model can take. vLLM 0.32 cannot recompute running requests that have
        images after a swap: preempted with their KV cache (with or without its multimodal and encoder caches
        cleared), they miss the encoder outputs they need ("Encoder cache miss") and the engine dies. Such a
        generator drains instead: the requests in flight finish on the old weights, the caches are cleared while
        none runs, and the next requests start on the new ones (their versions say which)."""
        return "drain" if mode == "recompute_kv" and self.image_token is not None else mode

    async def _load(self, version: int) -> None:
        """Reload the engine's weights from the store's `version` (prefetched) and label what follows."""
        if self.lora is not None:
            return await self._load_adapter(version)
        with self.store.pinned(version) as path:  # the writers must not recycle it mid-reload
            await self.engine.collective_rpc(self.reload_method, kwargs={"weights_path": str(path)})
        # The engine labels every step after this one with the new version (see generate).
        await self.engine.update_weight_version(str(version))
        self.policy_version = version

    # ---- LoRA adapters --------------------------------------------------------------------------

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
                    raise ValueError(
                        f"weights version {version} holds full weights, not a LoRA adapter: this "
                        "generator serves adapters (trainer.lora.rank > 0) and the trainer published "
                        "whole weights"
                    )
            shutil.copyfile(path / FILE, directory / "adapter_model.safetensors")
        (directory / "adapter_config.json").write_text(json.dumps(self.lora.peft_config(self.model)))
        request = LoRARequest(f"forge_rl-{version_dir(version)}", version + 1, str(directory))  # ids start at 1
        if not await self.engine.add_lora(request):
            raise RuntimeError(f"the vLLM engine refused LoRA adapter version {version} ({directory})")
        self._adapters[version] = request
        self.policy_version = version
        await self._drop_unused_adapters()

    def _use_adapter(self, version: int) -> Any:
        """The adapter a request started under `version` runs on to its end (vLLM cannot switch a running request's
        adapter): its vLLM LoRARequest, None for version 0 (the base model) or without LoRA. In use until
        `_done_with_adapter(version)`."""
        self._adapter_users[version] = self._adapter_users.get(version, 0) + 1
        return self._adapters.get(version)

    async def _done_with_adapter(self, version: int) -> None:
        """A request started under `version` ended: its adapter is dropped once no request uses it and it is old."""
        self._adapter_users[version] -= 1
        if not self._adapter_users[version]:
            del self._adapter_users[version]
        if self.lora is not None:
            await self._drop_unused_adapters()

    async def _drop_unused_adapters(self) -> None:
        """Remove adapters older than the current version, and not kept, once no request in flight uses them."""
        for version in list(self._adapters):
            # checked again at each one: another request's end, or keep_adapters, drops adapters while this awaits
            if version >= self.policy_version or version in self._kept_adapters or self._adapter_users.get(version):
                continue
            request = self._adapters.pop(version, None)
            if request is None:
                continue
            await self.engine.remove_lora(request.lora_int_id)
            shutil.rmtree(request.lora_path, ignore_errors=True)

    async def _keep_adapters(self, versions: list[int]) -> None:
        self._kept_adapters = set(versions)
        await self._drop_unused_adapters()

    def _loaded_adapter(self, version: int) -> int:
        """`version` if its adapter is loaded (0: the base model), for a request that names it."""
        if version and (self.lora is None or version not in self._adapters):
            raise ValueError(f"adapter_version={version} is not loaded on this generator (keep_adapters keeps one)")
        return version

    def _adapter_root(self):
        # Under the run's shared-memory prefix: the run's cleanup removes it whatever way this proc ends.
        return SHM_DIR / f"{run_prefix(os.environ.get(RUN_ID_ENV, 'local'))}lora-{os.getpid()}"

    async def _reload_adapters(self) -> None:
        """After a wake-up, load the LoRA adapters in use again. Sleep (level 1) keeps the base weights in host
        memory but not what the LoRA manager holds on the device, while the manager still lists the adapters
        as loaded: a vLLM issue reports adapters silently not applied after wake. Removing and adding each one
        loads it from its directory again (an adapter is small); `make gpu-check` checks LoRA after a wake."""
        for request in self._adapters.values():
            await self.engine.remove_lora(request.lora_int_id)
            if not await self.engine.add_lora(request):
                raise RuntimeError(f"the vLLM engine refused LoRA adapter {request.lora_path} after wake_up")

    # ---- holding the engine for another role (colocated placement) ------------------------------

    async def _hold(self) -> float:
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

    async def _release(self) -> float:
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

    def _lock(self) -> asyncio.Lock:
        if self._swap_lock is None:  # created on the actor's event loop, at first use
            self._swap_lock = asyncio.Lock()
        return self._swap_lock
