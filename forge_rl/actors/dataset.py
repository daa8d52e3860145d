"""Dataset actor: hands out a task's prompts, rendered and checked against the engine's length limit, in a
fixed order that a checkpoint's position restores. Each example handed out carries its group's sampling seed, from
the run's seed, the example's id and the count of examples handed out (`draws`, checkpointed with the position): the
same run samples the same tokens, resumed or not."""

import dataclasses

from monarch.actor import endpoint

from forge_rl.runtime import ForgeActor
from forge_rl.data.seeds import request_seed
from forge_rl.data.sources import DataError
from forge_rl.data.task import TaskConfig, TaskExample, TaskRows, render

# a stream that skips this many prompts in a row as too long is an error, not a silent endless loop
MAX_CONSECUTIVE_SKIPS = 10_000


class PromptDataset(ForgeActor):
    """`next()` is the next training example with its prompt rendered (`example.text`). Prompts whose tokens
    plus `max_tokens` exceed the engine's `max_model_len` are skipped and counted (`stats()["too_long"]`)."""

    def __init__(
        self,
        task: TaskConfig,
        model_dir: str,
        seed: int = 0,
        max_prompt_tokens: int | None = None,
        chat_template_kwargs: dict | None = None,
    ):
        from forge_rl.deps.transformers import auto_tokenizer

        self.task, self.seed, self.max_prompt_tokens = task, seed, max_prompt_tokens
        self.rows = TaskRows(task, seed)  # reads and checks the whole source: a bad file fails at spawn
        self.tokenizer = auto_tokenizer(model_dir)
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.too_long = 0  # training prompts skipped
        self.draws = 0  # training examples handed out: each one's sampling seed derives from its draw
        self.held_out_too_long = 0

    def _rendered(self, example: TaskExample) -> TaskExample | None:
        text = render(self.tokenizer, example, self.task, **self.chat_template_kwargs)
        if self.max_prompt_tokens is not None:
            n = len(self.tokenizer(text, add_special_tokens=False)["input_ids"])
            if n > self.max_prompt_tokens:
                return None
        return dataclasses.replace(example, text=text)

    @endpoint
    async def next(self) -> TaskExample:
        for _ in range(MAX_CONSECUTIVE_SKIPS):
            example = self._rendered(self.rows.next())
            if example is not None:
                self.draws += 1
                return dataclasses.replace(example, seed=request_seed(self.seed, example.id, self.draws))
            self.too_long += 1
        raise DataError(
            f"{MAX_CONSECUTIVE_SKIPS} prompts in a row of {self.task.source!r} are longer than "
            f"{self.max_prompt_tokens} tokens (the engine's max_model_len minus max_tokens)"
        )

    @endpoint
    async def held_out(self, n: int | None = None) -> list[TaskExample]:
        """The first `n` held-out examples that fit (all when None), rendered."""
        out = []
        self.held_out_too_long = 0
        for example in self.rows.held_out():
            if n is not None and len(out) >= n:
                break
            rendered = self._rendered(example)
            if rendered is None:
                self.held_out_too_long += 1
            else:
                out.append(rendered)
        return out

    @endpoint
    async def columns(self) -> list[str]:
        """The keyword arguments reward functions get from each row."""
        return self.rows.columns()

    @endpoint
    async def stats(self) -> dict:
        return {
            "position": self.rows.position,
            "epoch": self.rows.epoch,
            "too_long": self.too_long,
            "held_out_too_long": self.held_out_too_long,
            "rows": len(self.rows.examples) or None,
        }

    @endpoint
    async def state_dict(self) -> dict:
        return {
            "position": self.rows.position,
            "seed": self.seed,
            "source": self.task.source,
            "too_long": self.too_long,
            "draws": self.draws,
        }

    @endpoint
    async def load_state_dict(self, state: dict) -> None:
        if state.get("source", self.task.source) != self.task.source:
            raise ValueError(
                f"the checkpoint's data position is in {state['source']!r}; this run's task.source is "
                f"{self.task.source!r}"
            )
        if state["seed"] != self.seed:
            raise ValueError(f"dataset state is for seed {state['seed']}, this run uses seed {self.seed}")
        self.rows.seek(int(state["position"]))
        self.too_long = int(state.get("too_long", 0))
        self.draws = int(state.get("draws", state["position"]))  # a checkpoint without draws (an older format)
