"""Learned rewards as actors on procs of their own: a sequence classifier scored in batches, or an LLM judge.

    rewards:
      - {model: forge_rl/models/tiny_rm, kind: classifier, weight: 1.0}     # p(right) from an HF classifier
      - {model: /models/Qwen3-8B, kind: judge, weight: 0.5,                  # a vLLM judge, its text parsed
         template: "Rate 0-10: {prompt} -> {completion}. Score:", parser: "(\\d+)", scale: 0.1}
      - {name: format, weight: 0.1}                                          # function rewards mix in freely

`RewardModel` (kind classifier) loads a Hugging Face `AutoModelForSequenceClassification` checkpoint and scores
(prompt, completion) pairs rendered as a chat whose last turn is the completion. Requests that arrive within
`batch_window_ms` are run as one forward of at most `max_batch` sequences, so many groups scored at once cost one
batched forward, not one each. One label: the reward is the logit itself (a Bradley-Terry reward model's score);
two: softmax's p(label 1), in [0, 1].

A judge is a `Generator` actor (vLLM, one replica) started from the judge's checkpoint with greedy sampling; the reward actor
fills `template` ({prompt}, {completion}), renders it as a user turn with the judge's chat template, and turns the
judge's text into a number with `parser` (a regex whose first group is a float, or "package.module:function"),
times `scale`. Text it cannot parse fails the group as `reward_unparsable`, counted like every reward failure
(forge_rl/actors/reward.py); a model reward slower than `reward_timeout_s` fails it as `reward_timeout`.
"""

import asyncio
import math
import time
from dataclasses import dataclass

import torch
from monarch.actor import concurrent_endpoint, endpoint

from forge_rl.runtime import ForgeActor


def as_messages(prompt) -> list[dict[str, str]]:
    """A task's prompt (a string, or chat messages) as chat messages."""
    return list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]


@dataclass
class _Request:
    texts: list[str]
    done: asyncio.Future


class RewardModel(ForgeActor):
    """An HF sequence classifier that scores completions in batches (see the module doc)."""

    def __init__(self, model: str, max_batch: int = 64, batch_window_ms: float = 10.0):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from forge_rl.models import resolve_model_path

        if max_batch < 1 or batch_window_ms < 0:
            raise ValueError(f"reward model {model!r}: max_batch must be >= 1 and batch_window_ms >= 0")
        path = resolve_model_path(model)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        # on the GPU the placement pinned for it (resources.reward_model_gpus) in bf16, else on its cores in fp32
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = torch.bfloat16 if self.device == "cuda" else torch.float32
        self.model = AutoModelForSequenceClassification.from_pretrained(path, dtype=dtype).eval().to(self.device)
        labels = self.model.config.num_labels
        if labels not in (1, 2):
            raise ValueError(f"reward model {model!r} has {labels} labels; a reward classifier has 1 (its logit is "
                             "the score) or 2 (p(label 1) is)")
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model.config.pad_token_id = self.tokenizer.pad_token_id  # where HF pools: the last non-pad token
        self.max_batch, self.window_s = max_batch, batch_window_ms / 1000
        self.pending: list[_Request] = []
        self.batcher: asyncio.Task | None = None
        self.forwards = self.sequences = 0
        self.busy_s = 0.0

    def render(self, prompts: list, completions: list[str]) -> list[str]:
        return [self.tokenizer.apply_chat_template(as_messages(p) + [{"role": "assistant", "content": c}],
                                                   tokenize=False) for p, c in zip(prompts, completions)]

    @concurrent_endpoint  # groups arrive concurrently and are batched together
    async def score(self, prompts: list, completions: list[str]) -> list[float]:
        """The reward of each completion of its prompt: the logit (one label) or p(label 1) (two)."""
        if len(prompts) != len(completions):
            raise ValueError(f"score: {len(prompts)} prompts for {len(completions)} completions")
        request = _Request(self.render(prompts, completions), asyncio.get_running_loop().create_future())
        self.pending.append(request)
        if self.batcher is None or self.batcher.done():
            self.batcher = asyncio.create_task(self._run_batches())
        return await request.done

    async def _run_batches(self) -> None:
        """Wait a window for more requests, then run whole requests in forwards of at most max_batch sequences."""
        while self.pending:
            await asyncio.sleep(self.window_s)
            batch, size = [], 0
            while self.pending and (not batch or size + len(self.pending[0].texts) <= self.max_batch):
                batch.append(self.pending.pop(0))
                size += len(batch[-1].texts)
            try:
                scores = await asyncio.to_thread(self._forward, [t for r in batch for t in r.texts])
            except Exception as e:  # every request of the batch learns why
                for r in batch:
                    r.done.set_exception(e)
                continue
            for r in batch:
                r.done.set_result(scores[:len(r.texts)])
                scores = scores[len(r.texts):]

    def _forward(self, texts: list[str]) -> list[float]:
        start = time.perf_counter()
        with torch.no_grad():
            encoded = self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(self.device)
            logits = self.model(**encoded).logits.float()
        scores = logits[:, 0] if logits.shape[1] == 1 else torch.softmax(logits, -1)[:, 1]
        self.forwards += 1
        self.sequences += len(texts)
        self.busy_s += time.perf_counter() - start
        return scores.tolist()

    @endpoint
    async def stats(self) -> dict:
        return dict(forwards=self.forwards, sequences=self.sequences, busy_s=self.busy_s,
                    mean_batch=self.sequences / self.forwards if self.forwards else 0.0)


def judge_score(text: str, parser: str, scale: float) -> float | None:
    """The judge's verdict as a number (times `scale`), or None when `parser` finds none."""
    import re

    from forge_rl.rewards.workers import import_function

    if re.fullmatch(r"[\w.]+:\w+", parser):  # "package.module:function"
        value = import_function(parser)(text)
    else:
        match = re.search(parser, text)
        value = match.group(1) if match and match.groups() else (match.group(0) if match else None)
    try:
        number = float(value) if value is not None else None
    except ValueError:
        return None
    return number * scale if number is not None and math.isfinite(number) else None
