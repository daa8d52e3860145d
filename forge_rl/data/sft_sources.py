"""Where SFT batches come from: example i of a source is the same example every time, so batch `step` is
examples [step * B, (step + 1) * B) and a resumed run sees the data it would have seen.

    source = make_source("arithmetic" | path, tokenizer, seed, max_len)
    batches = train_batches(source, step, batch_size, dp, pad_id)   # one TrainBatch per data-parallel rank
"""

import sys

import torch

from forge_rl.data.jsonl import SFTExample, load_sft_dataset, tokenize_messages
from forge_rl.types import Completion, Episode, TrainBatch


class ArithmeticSource:
    """The arithmetic training stream (held-out questions excluded), example i = problem i of the stream."""

    def __init__(self, tokenizer, seed: int):
        from forge_rl.data.arithmetic import iter_training_problems

        self.tokenizer, self.stream, self.problems = tokenizer, iter_training_problems(seed), []
        self.cache: dict[str, SFTExample] = {}  # tokenised once per distinct question

    def example(self, i: int) -> SFTExample:
        while len(self.problems) <= i:
            self.problems.append(next(self.stream))
        p = self.problems[i]
        if p.question not in self.cache:
            msgs = [{"role": "user", "content": p.question}, {"role": "assistant", "content": p.answer}]
            self.cache[p.question] = tokenize_messages(self.tokenizer, msgs)
        return self.cache[p.question]

    def __len__(self) -> int:
        return sys.maxsize


class ListSource:
    """A finite dataset, reshuffled every epoch with a seed per epoch (deterministic, so resumable)."""

    def __init__(self, examples: list[SFTExample], seed: int):
        self.examples, self.seed, self.perms = examples, seed, {}

    def example(self, i: int) -> SFTExample:
        epoch, pos = divmod(i, len(self.examples))
        if epoch not in self.perms:
            g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            self.perms = {epoch: torch.randperm(len(self.examples), generator=g).tolist()}
        return self.examples[self.perms[epoch][pos]]

    def __len__(self) -> int:
        return len(self.examples)


class TaskSource:
    """The run's task (`task:`, as GRPO draws it) as SFT data: example i = row i of its seeded training stream, the
    prompt rendered by the model's chat template and the row's answer (task.answer_column) the target. A row's
    images (a vision-language model) are expanded by the model's processor into the ids the engine gives them, and
    kept beside the tokens for the trainer's vision tower."""

    def __init__(self, task, tokenizer, seed: int, max_len: int | None):
        from forge_rl.data.task import TaskRows

        self.rows, self.tokenizer, self.max_len = TaskRows(task, seed), tokenizer, max_len
        self.processor, self.examples = None, []

    def example(self, i: int) -> SFTExample:
        while len(self.examples) <= i:
            self.examples.append(self.tokenised(self.rows.next()))
        return self.examples[i]

    def tokenised(self, row) -> SFTExample:
        from forge_rl.data.sources import DataError

        if row.answer is None:
            raise DataError(f"{row.where}: no answer to train on (task.answer_column is null); SFT needs one")
        ex = tokenize_messages(self.tokenizer, [*row.messages, {"role": "assistant", "content": row.answer}])
        if row.images:
            ex = SFTExample(self._expanded(ex, row), ex.response_ids, row.images)
        if self.max_len is not None and len(ex.prompt_ids) + len(ex.response_ids) > self.max_len:
            raise DataError(
                f"{row.where}: {len(ex.prompt_ids) + len(ex.response_ids)} tokens after the chat template; the "
                f"limit (the model's max_seq_len) is {self.max_len}"
            )
        return ex

    def _expanded(self, ex: SFTExample, row) -> list[int]:
        """The prompt's ids with each image placeholder expanded to its image's tokens, by the model's processor."""
        from forge_rl.data.images import load_image
        from forge_rl.data.vision import load_processor

        if self.processor is None:
            self.processor = load_processor(self.tokenizer.name_or_path)
        text = self.tokenizer.decode(ex.prompt_ids, skip_special_tokens=False)
        images = [[load_image(image, row.where) for image in row.images]]
        ids = self.processor(text=[text], images=images)["input_ids"][0]  # as the engine expands them
        return list(map(int, ids))

    def __len__(self) -> int:
        return sys.maxsize if self.rows.streamed else len(self.rows.examples)


def make_source(dataset: str, tokenizer, seed: int, max_len: int | None, task=None):
    """`dataset`: "arithmetic" (generated in code), "task" (the run's `task:` rows and answers: `TaskSource`), or a
    local .jsonl file / HF dataset directory."""
    if dataset == "arithmetic":
        return ArithmeticSource(tokenizer, seed)
    if dataset == "task":
        return TaskSource(task, tokenizer, seed, max_len)
    return ListSource(load_sft_dataset(dataset, tokenizer, max_len=max_len), seed)


def train_batches(source, step: int, batch_size: int, dp: int, pad_id: int) -> list[TrainBatch]:
    """Batch `step` as one TrainBatch per data-parallel rank (rows dealt round-robin). SFT needs no
    advantages or behaviour logprobs: zeros, and policy version 0 on response tokens."""
    episodes = []
    for i in range(step * batch_size, (step + 1) * batch_size):
        ex = source.example(i)
        R = len(ex.response_ids)
        c = Completion(
            prompt_ids=torch.tensor(ex.prompt_ids, dtype=torch.long),
            response_ids=torch.tensor(ex.response_ids, dtype=torch.long),
            logprobs=torch.zeros(R),
            policy_versions=torch.zeros(R, dtype=torch.long),
            finish_reason="stop",
            images=ex.images,
        )
        episodes.append(Episode(c, advantage=0.0))
    return [TrainBatch.collate(episodes[r::dp], pad_id=pad_id) for r in range(dp)]
