"""A task: the prompts an RL app trains on, how they become chat prompts, and what reward functions see.

    task:                                  # in an app's config
      source: data/train.jsonl             # a file, an HF dataset directory, "package.module:function",
                                           # or a built-in task name ("arithmetic")
      prompt_column: question              # a string (one user turn) or a list of chat messages
      answer_column: answer                # reaches reward functions as `answer=`
      system_prompt: "Answer with a number."
      held_out: data/test.jsonl            # or a split name of `source`, or held_out_fraction: 0.05

`source: reasoning_gym:NAME` trains on a reasoning-gym task, its rows and both splits made from one seed by
`task.reasoning_gym` (forge_rl/data/reasoning_gym.py).

Every row becomes a `TaskExample`: an id, the prompt as the row has it, the chat messages given to the
template (system prompt, few-shot turns, then the prompt), the answer, and every other column. Reward
functions get those columns as keyword arguments, one value per completion (TRL's convention), so a reward can
use the answer, test cases or any metadata of its row.

A row that is not usable raises `DataError` naming the row and the column, when the source is loaded: a bad
file fails at start, never mid-run.
"""

import dataclasses
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import jinja2

from forge_rl.data.images import check_image_sizes, image_base_dir, model_max_pixels, row_images
from forge_rl.data.reasoning_gym import ReasoningGymConfig, reasoning_gym_splits
from forge_rl.data.sources import DataError, is_callable_source, is_reasoning_gym_source, read_rows
from forge_rl.data.vision import check_vision_model, with_images

# Built-in tasks: a name in `task.source` stands for these settings.
TASKS = {
    "arithmetic": dict(
        source="forge_rl.data.arithmetic:training_rows", held_out="forge_rl.data.arithmetic:held_out_rows"
    ),
    # two digits drawn into an image, the answer their sum (a vision-language model's task: docs/vision.md)
    "digit_sum": dict(
        source="forge_rl.data.digit_sum:training_rows",
        held_out="forge_rl.data.digit_sum:held_out_rows",
        image_column="image",
    ),
    # the same images, the answer the two digits read left to right
    "digit_read": dict(
        source="forge_rl.data.digit_sum:reading_rows",
        held_out="forge_rl.data.digit_sum:held_out_reading_rows",
        image_column="image",
    ),
}
ROLES = ("system", "user", "assistant", "tool")
# keyword arguments reward functions get from forge_rl itself; a column may not take these names
RESERVED_COLUMNS = ("prompts", "completions", "finish_reason")


@dataclass
class TaskConfig:
    source: str = "arithmetic"  # a name in TASKS, a file, an HF dataset directory or "package.module:function"
    split: str | None = None  # the split of `source` to train on (HF directories, functions); default: train
    prompt_column: str = "prompt"  # a string, or a list of {role, content} chat messages
    answer_column: str | None = "answer"  # null: the task has no reference answer
    id_column: str | None = None  # default: the row's position in the source
    columns: dict[str, str] = field(default_factory=dict)  # renames for the rewards, e.g. {test_list: tests}
    system_prompt: str | None = None  # prepended as a system turn (unless the row's messages have one)
    few_shot: list[dict[str, str]] = field(default_factory=list)  # [{prompt, answer}]: earlier user/assistant turns
    chat_template: bool = True  # false: the prompt text is given to the model as it is (base models)
    shuffle: bool = True  # reshuffle file rows every epoch (seeded); functions keep their own order
    held_out: str | None = None  # a split name of `source`, a file or directory, or "package.module:function"
    held_out_fraction: float = 0.0  # or: hold out this fraction of `source`'s rows
    split_seed: int = 0  # which rows held_out_fraction takes (independent of the run's seed)
    eval_reward: str | None = None  # the reward whose held-out mean is eval/accuracy; default: the first reward
    # a column of images (one, or a list) the prompt shows, at its "<image>" markers: docs/vision.md
    image_column: str | None = None
    # source reasoning_gym:NAME: the task's config, prompt template and split sizes (split_seed is its seed)
    reasoning_gym: ReasoningGymConfig = field(default_factory=ReasoningGymConfig)

    def __post_init__(self) -> None:
        if not 0.0 <= self.held_out_fraction < 1.0:
            raise ValueError(f"task.held_out_fraction must be in [0, 1), got {self.held_out_fraction}")
        if self.held_out_fraction and self.held_out:
            raise ValueError(
                f"task.held_out={self.held_out!r} and task.held_out_fraction={self.held_out_fraction}: give one"
            )
        for i, shot in enumerate(self.few_shot):
            if not isinstance(shot, dict) or set(shot) != {"prompt", "answer"}:
                raise ValueError(f"task.few_shot[{i}] must be {{prompt: ..., answer: ...}}, got {shot!r}")
        if is_reasoning_gym_source(self.source):
            for key in ("split", "held_out"):
                if getattr(self, key) is not None:
                    raise ValueError(
                        f"task.{key}={getattr(self, key)!r}: a reasoning-gym task's splits are "
                        "task.reasoning_gym.train_size and held_out_size (of one seed, task.split_seed)"
                    )
            if self.held_out_fraction:
                raise ValueError(
                    f"task.held_out_fraction={self.held_out_fraction}: a reasoning-gym task holds out "
                    "task.reasoning_gym.held_out_size questions instead"
                )

    def resolved(self) -> "TaskConfig":
        """This config with a built-in task's name replaced by its settings (those not set here)."""
        if self.source not in TASKS:
            return self
        builtin = TASKS[self.source]
        return dataclasses.replace(
            self, **{k: v for k, v in builtin.items() if k == "source" or getattr(self, k) is None}
        )


@dataclass(frozen=True)
class TaskExample:
    id: str
    prompt: str | list[dict[str, str]]  # as in the row: what reward functions get as `prompts`
    messages: list[dict[str, str]]  # what the chat template renders: system, few-shot turns, then the prompt
    answer: str | None
    columns: dict[str, Any]  # reward keyword arguments: `answer` and every column but the prompt
    where: str  # the file and line (or row) it came from
    text: str = ""  # the rendered prompt the generator is given (see `render`)
    # the sampling seed of the group drawn from it (the dataset actor's, per draw: forge_rl/data/seeds.py);
    # None: the engine samples unseeded
    seed: int | None = None
    images: tuple[bytes, ...] = ()  # task.image_column's images, checked and PNG-encoded (forge_rl/data/images.py)


def to_example(row: dict, where: str, index: int, cfg: TaskConfig) -> TaskExample:
    """Validate one row and map its columns; errors name the row and the column (and its config key)."""
    if cfg.prompt_column not in row:
        raise DataError(f"{where}: no column {cfg.prompt_column!r} (task.prompt_column); the row has {sorted(row)}")
    prompt = row[cfg.prompt_column]
    messages = _prompt_messages(prompt, where, cfg)
    images = row_images(row, where, cfg.image_column, image_base_dir(cfg.source))
    if images:
        messages = with_images(messages, len(images), where)
    answer = None
    if cfg.answer_column is not None:
        if cfg.answer_column not in row:
            raise DataError(
                f"{where}: no column {cfg.answer_column!r} (task.answer_column); the row has "
                f"{sorted(row)}; set task.answer_column: null for a task without answers"
            )
        answer = row[cfg.answer_column]
        if answer is None or isinstance(answer, (dict, list)):
            raise DataError(
                f"{where}: column {cfg.answer_column!r} (task.answer_column) must be a string or a "
                f"number, got {answer!r:.80}"
            )
        answer = str(answer)
    for name in RESERVED_COLUMNS:
        if name in row:
            raise DataError(f"{where}: column {name!r} would clash with the reward argument of that name; rename it")
    columns = {k: v for k, v in row.items() if k not in (cfg.prompt_column, cfg.image_column)}
    for column, name in cfg.columns.items():  # the reward's parameter name for a column of the data
        if column not in row:
            raise DataError(
                f"{where}: no column {column!r} (task.columns maps it to {name!r}); the row has {sorted(row)}"
            )
        if name in RESERVED_COLUMNS:
            raise DataError(f"task.columns maps {column!r} to {name!r}, which is a reward argument forge_rl sets")
        columns[name] = columns.pop(column, row[column])
    if answer is not None:
        columns["answer"] = answer
    if cfg.id_column is not None:
        if cfg.id_column not in row:
            raise DataError(f"{where}: no column {cfg.id_column!r} (task.id_column)")
        example_id = str(row[cfg.id_column])
    else:
        example_id = str(row.get("id", index))
    return TaskExample(example_id, prompt, messages, answer, columns, where, images=images)


def _prompt_messages(prompt: Any, where: str, cfg: TaskConfig) -> list[dict[str, str]]:
    col = f"column {cfg.prompt_column!r} (task.prompt_column)"
    if isinstance(prompt, str):
        if not prompt.strip():
            raise DataError(f"{where}: {col} is empty")
        turns = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list) and prompt:
        if not cfg.chat_template:
            raise DataError(f"{where}: {col} holds chat messages, but task.chat_template is false")
        for i, m in enumerate(prompt):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise DataError(
                    f"{where}: {col}[{i}] must be an object with string 'role' and 'content', got {m!r:.100}"
                )
            if m["role"] not in ROLES:
                raise DataError(f"{where}: {col}[{i}] has role {m['role']!r}; expected one of {ROLES}")
        turns = [{"role": m["role"], "content": m["content"]} for m in prompt]
    else:
        raise DataError(f"{where}: {col} must be a string or a non-empty list of chat messages, got {prompt!r:.80}")
    shots = []
    for shot in cfg.few_shot:
        shots += [{"role": "user", "content": shot["prompt"]}, {"role": "assistant", "content": shot["answer"]}]
    system = (
        []
        if turns[0]["role"] == "system" or cfg.system_prompt is None
        else [{"role": "system", "content": cfg.system_prompt}]
    )
    if turns[0]["role"] == "system":  # the row's own system turn stays first, before the few-shot turns
        system, turns = turns[:1], turns[1:]
    return system + shots + turns


def render(tokenizer, example: TaskExample, cfg: TaskConfig, **chat_template_kwargs) -> str:
    """The prompt text the generator continues: the chat template with the generation prompt appended, or
    (task.chat_template: false) the system prompt, few-shot pairs and prompt as plain text. An example with images
    needs a vision-language model: the tokenizer's model is checked (a ConfigError for a text-only one), and its
    images against the model's processor's pixel limit."""
    if example.images:
        model_dir = getattr(tokenizer, "name_or_path", "")
        check_vision_model(model_dir)
        check_image_sizes(example.images, model_max_pixels(model_dir), example.where)
    if cfg.chat_template:
        if not getattr(tokenizer, "chat_template", None):
            raise DataError(
                "the model's tokenizer has no chat template; set task.chat_template: false to give "
                "prompts as plain text"
            )
        try:
            return tokenizer.apply_chat_template(
                example.messages, tokenize=False, add_generation_prompt=True, **chat_template_kwargs
            )
        except jinja2.TemplateError as e:  # a template that does not parse, or fails on this prompt's messages
            where = f" line {e.lineno}" if getattr(e, "lineno", None) else ""
            raise DataError(
                f"the model's chat template{where} does not render example {example.id} "
                f"({type(e).__name__}: {' '.join(str(e).split())[:200]}); fix chat_template in "
                f"{getattr(tokenizer, 'name_or_path', 'the model directory')}'s tokenizer_config.json (or "
                "chat_template.jinja), or set task.chat_template: false to give prompts as plain text"
            ) from None
    text = ""
    for m in example.messages:  # a few-shot answer follows its prompt directly, as the model should answer
        text += m["content"] + ("\n\n" if m["role"] in ("system", "assistant") else "")
    return text


class TaskRows:
    """A task's train stream and held-out set. File rows are checked at construction; the train stream is
    addressed by position (epoch-shuffled with the seed), so a resumed run continues where it stopped."""

    def __init__(self, cfg: TaskConfig, seed: int = 0):
        cfg = cfg.resolved()
        self.cfg, self.seed = cfg, seed
        self._held_out: list[TaskExample] | None = None
        if is_reasoning_gym_source(cfg.source):  # both splits at once, from one seed (split_seed, not the run's)
            rows, held_out = reasoning_gym_splits(cfg.source, cfg.reasoning_gym, cfg.split_seed)
            self._held_out = [to_example(row, where, i, cfg) for i, (where, row) in enumerate(held_out)]
        else:
            rows = read_rows(cfg.source, cfg.split, seed)
        self.streamed = not isinstance(rows, list)
        if self.streamed:
            if cfg.held_out_fraction:
                raise DataError(
                    f"task.held_out_fraction: {cfg.source!r} yields rows lazily (maybe endlessly); "
                    "give task.held_out instead"
                )
            self.examples: list[TaskExample] = []
        else:
            examples = [to_example(row, where, i, cfg) for i, (where, row) in enumerate(rows)]
            if cfg.held_out_fraction:
                k = max(1, round(len(examples) * cfg.held_out_fraction))
                if k >= len(examples):
                    raise DataError(
                        f"task.held_out_fraction={cfg.held_out_fraction} of {len(examples)} rows leaves "
                        "none to train on"
                    )
                held = set(random.Random(cfg.split_seed).sample(range(len(examples)), k))
                self._held_out = [e for i, e in enumerate(examples) if i in held]
                examples = [e for i, e in enumerate(examples) if i not in held]
            self.examples = examples
        self.position = 0
        self._epoch_order: tuple[int, list[int]] = (-1, [])
        self._stream: Iterator[TaskExample] | None = None
        self.seek(0)

    def seek(self, position: int) -> None:
        self.position = position
        if self.streamed:
            rows = read_rows(self.cfg.source, self.cfg.split, self.seed)
            self._stream = (to_example(row, where, i, self.cfg) for i, (where, row) in enumerate(rows))
            for _ in range(position):
                next(self._stream)

    def next(self) -> TaskExample:
        if self.streamed:
            try:
                example = next(self._stream)
            except StopIteration:  # a finite generator: start it again, as an epoch
                self.seek(0)
                example = next(self._stream)
        else:
            epoch, i = divmod(self.position, len(self.examples))
            example = self.examples[self._order(epoch)[i]]
        self.position += 1
        return example

    def _order(self, epoch: int) -> list[int]:
        """The epoch's row order, shuffled once per epoch (not per row: datasets have millions of rows)."""
        if self._epoch_order[0] != epoch:
            order = list(range(len(self.examples)))
            if self.cfg.shuffle:
                random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            self._epoch_order = (epoch, order)
        return self._epoch_order[1]

    @property
    def epoch(self) -> int:
        return 0 if self.streamed or not self.examples else self.position // len(self.examples)

    def held_out(self) -> list[TaskExample]:
        """The held-out examples (empty when the task has none)."""
        if self._held_out is None:
            source = self.cfg.held_out
            if source is None:
                self._held_out = []
            else:
                if is_callable_source(source) or _looks_like_path(source):
                    rows = read_rows(source, None, self.seed)
                else:  # a split name of the training source
                    try:
                        rows = read_rows(self.cfg.source, source, self.seed)
                    except DataError as e:
                        raise DataError(
                            f"task.held_out={source!r}, not a file or 'package.module:function', is read as a split "
                            f"name of task.source, and: {e}"
                        ) from None
                if not isinstance(rows, list):
                    raise DataError(
                        f"task.held_out {source!r} yields rows lazily; the held-out set must be finite (return a list)"
                    )
                self._held_out = [to_example(row, where, i, self.cfg) for i, (where, row) in enumerate(rows)]
        return self._held_out

    def columns(self) -> list[str]:
        """The reward keyword arguments every example has (from the first example)."""
        if self.examples:
            return sorted(self.examples[0].columns)
        where, row = next(iter(read_rows(self.cfg.source, self.cfg.split, self.seed)))
        return sorted(to_example(row, where, 0, self.cfg).columns)


# prompts of a training stream whose lengths are checked at start (not all: a source may have millions)
PROMPTS_CHECKED = 64


def first_prompts(rows: TaskRows, n: int = PROMPTS_CHECKED) -> list[TaskExample]:
    """The first `n` examples of the training stream, leaving `rows` where it is."""
    if not rows.streamed:
        return rows.examples[:n]
    fresh = TaskRows(rows.cfg, rows.seed)
    return [fresh.next() for _ in range(n)]


def check_prompts_fit(
    what: str, examples: list[TaskExample], tokenizer, task: TaskConfig, limit: int, why: str, **chat_template_kwargs
) -> None:
    """DataError when none of `examples` (`what`: "task.source 'x'") is at most `limit` tokens once rendered: each
    would be skipped, one by one (`why`: where the limit comes from, what to change)."""
    n = [
        len(tokenizer(render(tokenizer, e, task, **chat_template_kwargs), add_special_tokens=False)["input_ids"])
        for e in examples
    ]
    if n and min(n) > limit:
        raise DataError(
            f"{what}: none of its first {len(n)} prompts fits in {limit} tokens (the shortest has {min(n)}): {why}"
        )


def _looks_like_path(source: str) -> bool:
    from pathlib import Path

    return "/" in source or Path(source).suffix != "" or Path(source).exists()
