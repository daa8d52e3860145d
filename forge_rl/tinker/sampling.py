"""Sampling clients: weights a training client saved, served by the service's one generator (a vLLM engine in
forge_rl's Generator actor) whichever user or training client saved them. Saving publishes the trainer's weights
as a new version of the weight store (the adapter alone under LoRA) and loads it into the generator; a sampling
client samples that version.

Under LoRA the engine serves several adapters at once: the newest `kept_saves` saved adapters of every training
client stay loaded (keep_adapters) and each request names its own (generate's adapter_version), so one user's saving
never disturbs another's sampling, and a loop that samples with the weights of a step or two ago while it trains
(tinker-cookbook's async mode) still samples exactly those. A sampling client of an older save of the same training
client is stale and refused, naming what to do (save again). With every weight trained (lora_rank 0) the generator
holds one version at a time, the newest saved by anyone. Prompt logprobs (compute_logprobs) come from the trainer
that saved the weights, which holds them until its next optimizer step.
"""

import asyncio
import itertools
from dataclasses import dataclass

import numpy as np

from forge_rl.tinker.config import TinkerConfig
from forge_rl.tinker.errors import NotServed, Refused
from forge_rl.tinker.trainer import Row
from forge_rl.tinker.training import Training, TrainingModel
from forge_rl.tinker.wire import Sequence, sample_response


@dataclass
class SamplerWeights:
    sampler_id: str
    owner: str
    version: int  # of the weight store; 0: the base model
    model: TrainingModel | None  # the training client that saved them (None: the base model)
    step: int  # its optimizer steps when it saved
    path: str | None = None


class Sampling:
    def __init__(self, cfg: TinkerConfig, training: Training, generator):
        self.cfg, self.training, self.generator = cfg, training, generator
        self.samplers: dict[str, SamplerWeights] = {}
        self.paths: dict[str, SamplerWeights] = {}
        self.current = 0  # the generator's newest version
        self.kept: dict[str, list[int]] = {}  # LoRA: training client -> its newest saved versions, on the generator
        self._publishing = asyncio.Lock()  # versions reach the generator in the order they are numbered
        self._versions = itertools.count(1)
        self._ids = itertools.count(1)

    def sampler(self, owner: str, sampler_id: str) -> SamplerWeights:
        found = self.samplers.get(sampler_id)
        if found is None or found.owner != owner:
            raise Refused(f"no sampling client {sampler_id!r} for this key")
        return found

    def _new(self, owner: str, version: int, model: TrainingModel | None, path: str | None = None) -> SamplerWeights:
        sampler = SamplerWeights(f"sampler-{next(self._ids)}", owner, version, model, model.steps if model else 0, path)
        self.samplers[sampler.sampler_id] = sampler
        return sampler

    async def save(self, owner: str, model_id: str, name: str | None) -> dict:
        """Publish the training client's weights, swap the generator to them; a sampling session of them (and with
        `name`, a tinker:// path another sampling client can name)."""
        model = self.training.model(owner, model_id)
        async with model.lock, self._publishing:
            version = next(self._versions)
            await model.use()
            await model.trainer.push_weights.call(version)
            if self.cfg.lora_rank:  # every open training client's newest saves stay, older ones go
                kept = {m: v for m, v in self.kept.items() if m in self.training.models}
                kept[model_id] = [*kept.get(model_id, []), version][-self.cfg.kept_saves :]
                await self.generator.keep_adapters.call_all(sorted(v for vs in kept.values() for v in vs))
                self.kept = kept
            await self.generator.update_weights.call_all(version)
            self.current = version
        path = f"tinker://{model_id}/sampler_weights/{name}" if name else None
        sampler = self._new(owner, version, model, path)
        if path:
            self.paths[path] = sampler
        return {"path": path, "sampling_session_id": None if path else sampler.sampler_id}

    def open(self, owner: str, model_path: str | None, base_model: str | None) -> str:
        """A sampling session of saved weights (by path) or of the base model."""
        if model_path:
            saved = self.paths.get(model_path)
            if saved is None or saved.owner != owner:
                raise Refused(f"no saved weights at {model_path!r} for this key: save_weights_for_sampler(name) first")
            return self._new(owner, saved.version, saved.model, model_path).sampler_id
        self.cfg.check_base_model(base_model, self.training.model_dir)
        return self._new(owner, 0, None).sampler_id

    def _check_current(self, sampler: SamplerWeights) -> None:
        if self.cfg.lora_rank and (sampler.version == 0 or any(sampler.version in vs for vs in self.kept.values())):
            return
        if sampler.version != self.current or self.cfg.lora_rank:
            kept = self.cfg.kept_saves
            newer = f"its training client's {kept} newer saves" if self.cfg.lora_rank else "newer saved weights"
            raise Refused(
                f"stale sampling client: it samples weights version {sampler.version}, which {newer} replaced on "
                "this server's generator; call save_weights_and_get_sampling_client again"
            )

    async def sample(self, owner: str, request) -> bytes:
        """`num_samples` completions of the prompt, each token with its logprob; and prompt logprobs if asked."""
        sampler = self.sampler(owner, request.sampling_session_id)
        _refuse_unserved(request)
        prompt = [t for chunk in request.prompt.chunks for t in _text_tokens(chunk)]
        params = request.sampling_params
        max_tokens = params.max_tokens or 16
        if not 1 <= request.num_samples <= self.cfg.max_samples:
            raise Refused(f"num_samples={request.num_samples}: give 1 to max_samples={self.cfg.max_samples}")
        if request.num_samples > 1 and params.temperature == 0:  # vLLM samples greedily one answer per prompt
            raise Refused(
                f"num_samples={request.num_samples} at temperature 0: greedy sampling has one answer; ask for "
                "num_samples=1 or a temperature above 0"
            )
        if not prompt or len(prompt) + max_tokens > self.cfg.max_sequence_tokens:
            raise Refused(
                f"a prompt of {len(prompt)} tokens with max_tokens={max_tokens}: the two must fit in "
                f"max_sequence_tokens={self.cfg.max_sequence_tokens} (and the prompt hold one token)"
            )
        if max(prompt) >= self.training.vocab_size or min(prompt) < 0:
            raise Refused(f"a prompt token id outside the vocabulary [0, {self.training.vocab_size})")
        self._check_current(sampler)
        options = _options(params, max_tokens)
        if self.cfg.lora_rank:  # this client's own adapter, whatever others saved since
            options["adapter_version"] = sampler.version
        try:
            completions = await self.generator.generate.route(prompt, n=request.num_samples, **options)
        except Exception:
            self._check_current(sampler)  # its adapter was replaced while the call was on its way: say so
            raise
        if any(bool(c.policy_versions.ne(sampler.version).any()) for c in completions):
            self._check_current(sampler)  # newer weights were saved while the call was on its way
        sequences = [
            Sequence(c.response_ids.tolist(), c.logprobs.tolist(), c.finish_reason == "stop") for c in completions
        ]
        scored = await self.prompt_logprobs(sampler, prompt) if request.prompt_logprobs else None
        if scored is not None and request.prompt_logprobs_last_n:  # only the last n scored, as asked
            keep = request.prompt_logprobs_last_n
            scored = [float("nan")] * (len(scored) - keep) + scored[len(scored) - keep :]
        return sample_response(sequences, scored)

    async def prompt_logprobs(self, sampler: SamplerWeights, prompt: list[int]) -> list[float]:
        """Each prompt token's logprob given the ones before it (NaN for the first), from the trainer that saved
        the sampler's weights, while it still holds them."""
        model = sampler.model
        if model is None:
            raise Refused("prompt logprobs of the base model are not served; save weights of a training client first")
        async with model.lock:
            if model.closed:
                raise Refused("the training client that saved these weights has been closed with its session")
            if model.steps != sampler.step:
                raise Refused(
                    "stale sampling client: its training client has taken an optimizer step since these weights "
                    "were saved, so prompt logprobs of them are gone; save again"
                )
            row = (
                Row(prompt[:-1], prompt[1:], {"weights": np.zeros(len(prompt) - 1, np.float32)})
                if len(prompt) > 1
                else None
            )
            await model.use()
            results = await model.trainer.forward_backward.call([row] if row else [], "cross_entropy", {}, True)
        logprobs = next((lp for index, lps, _ in results.values() for lp in lps), np.zeros(0, np.float32))
        return [float("nan")] + logprobs.tolist()


def _refuse_unserved(request) -> None:
    """The sampling options this service does not serve, refused by name rather than ignored."""
    asked = {
        "topk_prompt_logprobs": request.topk_prompt_logprobs,
        "topk_sample_logprobs": request.topk_sample_logprobs,
        "prompt_alt_tokens_k": request.prompt_alt_tokens_k,
        "target_prompt_logprobs": request.target_prompt_logprobs is not None,
        "record_stability_info": bool(request.record_stability_info),
    }
    for name, value in asked.items():
        if value:
            raise NotServed(f"sampling with {name}", "sample without it (per-token logprobs of samples are served)")


def _text_tokens(chunk) -> list[int]:
    if getattr(chunk, "type", None) != "encoded_text":
        raise Refused(f"a prompt chunk of type {getattr(chunk, 'type', '?')!r}: this server takes text chunks only")
    return list(chunk.tokens)


def _options(params, max_tokens: int) -> dict:
    """vLLM's sampling options of the client's SamplingParams."""
    options = dict(max_tokens=max_tokens, temperature=params.temperature)
    if params.top_p is not None and params.top_p < 1:
        options["top_p"] = params.top_p
    if params.top_k is not None and params.top_k > 0:
        options["top_k"] = params.top_k
    if params.seed is not None:
        options["seed"] = params.seed
    stop = params.stop
    if isinstance(stop, str):
        options["stop"] = [stop]
    elif stop and all(isinstance(s, int) for s in stop):
        options["stop_token_ids"] = list(stop)
    elif stop:
        options["stop"] = list(stop)
    return options
