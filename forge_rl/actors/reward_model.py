"""Learned rewards as actors on procs of their own: a sequence classifier scored in batches, or an LLM judge.

    rewards:
      - {model: forge_rl/models/tiny_rm, kind: classifier, weight: 1.0}     # p(right) from an HF classifier
      - {model: /models/Qwen3-8B, kind: judge, weight: 0.5,                  # a vLLM judge, its text parsed
         template: "Rate 0-10: {prompt} -> {completion}. Score:", parser: "(\\d+)", scale: 0.1}
      - {name: format, weight: 0.1}                                          # function rewards mix in freely

`RewardModel` (kind classifier) loads a Hugging Face `AutoModelForSequenceClassification` checkpoint and scores
(prompt, completion) pairs rendered as a chat whose last turn is the completion. Requests that arrive within
`batch_window_ms` are run together in forwards of at most `max_batch` sequences, so many groups scored at once cost
one batched forward, not one each. A request past its caller's deadline (`timeout_s`, the reward timeout) is dropped
before its forward, so abandoned work does not pile up; a batch whose forward fails is retried request by request,
so one bad request fails alone. A sequence longer than the model's context keeps the end of its completion
(`fit_completion`). One label: the reward is the logit itself (a Bradley-Terry reward model's score); two:
softmax's p(label 1), in [0, 1].

A judge is a `Generator` actor (vLLM, one replica) started from the judge's checkpoint with greedy sampling; the
reward actor
fills `template` ({prompt}, {completion}), renders it as a user turn with the judge's chat template, and turns the
judge's text into a number with `parser` (a regex whose first group is a float, or "package.module:function"),
times `scale`. Text it cannot parse fails the group as `reward_unparsable`, counted like every reward failure
(forge_rl/actors/reward.py); a model reward slower than `reward_timeout_s` fails it as `reward_timeout`.
"""

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from monarch.actor import concurrent_endpoint, endpoint

from forge_rl.rewards.judge import judge_score  # noqa: F401 (re-exported)
from forge_rl.runtime import ForgeActor


def as_messages(prompt) -> list[dict[str, str]]:
    """A task's prompt (a string, or chat messages) as chat messages."""
    return list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]


def fit_completion(render: Callable[[str], str], completion: str, tokenizer, limit: int) -> str:
    """`render(completion)`, with the completion cut to its last tokens when the whole would pass `limit` tokens
    (the model's context): the end of an answer (its verdict, its final number) is what a reward model reads.
    Raises ValueError when the rest of the text alone leaves no room for the completion."""

    def length(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False).input_ids)

    text = render(completion)
    over = length(text) - limit
    if over <= 0:
        return text
    ids = tokenizer(completion, add_special_tokens=False).input_ids
    room = len(ids) - over
    for _ in range(4):  # decoding then re-encoding a cut can shift a token or two
        if room <= 0:
            raise ValueError(
                f"the reward model's input passes its context of {limit} tokens even without the completion"
            )
        text = render(tokenizer.decode(ids[-room:]))
        if (over := length(text) - limit) <= 0:
            return text
        room -= over
    raise ValueError(f"the completion could not be cut to fit the reward model's context of {limit} tokens")


@dataclass
class _Request:
    texts: list[str]
    done: asyncio.Future
    deadline: float | None = None  # time.monotonic() past which nobody waits for it: it is dropped, not run


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
            raise ValueError(
                f"reward model {model!r} has {labels} labels; a reward classifier has 1 (its logit is "
                "the score) or 2 (p(label 1) is)"
            )
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model.config.pad_token_id = self.tokenizer.pad_token_id  # where HF pools: the last non-pad token
        self.max_batch, self.window_s = max_batch, batch_window_ms / 1000
        self.context = int(getattr(self.model.config, "max_position_embeddings", 0) or self.tokenizer.model_max_length)
        self.pending: list[_Request] = []
        self.batcher: asyncio.Task | None = None
        self.forwards = self.sequences = self.expired = self.largest_forward = 0
        self.busy_s = 0.0

    def render(self, prompts: list, completions: list[str]) -> list[str]:
        """Each (prompt, completion) as a chat whose last turn is the completion, cut to the model's context."""

        def chat(prompt) -> Callable[[str], str]:
            return lambda c: self.tokenizer.apply_chat_template(
                as_messages(prompt) + [{"role": "assistant", "content": c}], tokenize=False
            )

        return [fit_completion(chat(p), c, self.tokenizer, self.context) for p, c in zip(prompts, completions)]

    @concurrent_endpoint  # groups arrive concurrently and are batched together
    async def score(self, prompts: list, completions: list[str], timeout_s: float | None = None) -> list[float]:
        """The reward of each completion of its prompt: the logit (one label) or p(label 1) (two). Not run at
        all once `timeout_s` has passed (TimeoutError): its caller has given up on it."""
        if len(prompts) != len(completions):
            raise ValueError(f"score: {len(prompts)} prompts for {len(completions)} completions")
        deadline = time.monotonic() + timeout_s if timeout_s is not None else None
        request = _Request(self.render(prompts, completions), asyncio.get_running_loop().create_future(), deadline)
        self.pending.append(request)
        if self.batcher is None or self.batcher.done():
            self.batcher = asyncio.create_task(self._run_batches())
        return await request.done

    async def _run_batches(self) -> None:
        """Wait a window for more requests, then run those still wanted, whole, in forwards of at most
        max_batch sequences (a request longer than that alone, in several)."""
        while self.pending:
            await asyncio.sleep(self.window_s)
            batch, size = [], 0
            while self.pending and (not batch or size + len(self.pending[0].texts) <= self.max_batch):
                request = self.pending.pop(0)
                if request.deadline is not None and time.monotonic() > request.deadline:
                    self.expired += 1
                    request.done.set_exception(TimeoutError("the request's deadline passed before its forward"))
                    continue
                batch.append(request)
                size += len(request.texts)
            if batch:
                await self._score_batch(batch)

    async def _score_batch(self, batch: list[_Request]) -> None:
        """Every request of `batch` gets its scores; when the batched forward fails, each is retried alone, so
        only the request that fails learns why."""
        try:
            scores = await asyncio.to_thread(self._forward_all, [t for r in batch for t in r.texts])
        except Exception as e:
            if len(batch) == 1:
                batch[0].done.set_exception(e)
                return
            for r in batch:
                await self._score_batch([r])
            return
        for r in batch:
            r.done.set_result(scores[: len(r.texts)])
            scores = scores[len(r.texts) :]

    def _forward_all(self, texts: list[str]) -> list[float]:
        return [v for i in range(0, len(texts), self.max_batch) for v in self._forward(texts[i : i + self.max_batch])]

    def _forward(self, texts: list[str]) -> list[float]:
        start = time.perf_counter()
        with torch.no_grad():
            encoded = self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(self.device)
            logits = self.model(**encoded).logits.float()
        scores = logits[:, 0] if logits.shape[1] == 1 else torch.softmax(logits, -1)[:, 1]
        self.forwards += 1
        self.sequences += len(texts)
        self.largest_forward = max(self.largest_forward, len(texts))
        self.busy_s += time.perf_counter() - start
        return scores.tolist()

    @endpoint
    async def stats(self) -> dict:
        return dict(
            forwards=self.forwards,
            sequences=self.sequences,
            busy_s=self.busy_s,
            expired=self.expired,
            largest_forward=self.largest_forward,
            mean_batch=self.sequences / self.forwards if self.forwards else 0.0,
        )
