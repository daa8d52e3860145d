"""Local SFT datasets: JSONL files or HF-format dataset directories -> (prompt_ids, response_ids).

Each record (a JSONL line, or a row of a `datasets.load_from_disk` directory) is one of

    {"prompt": "12+34=", "completion": "46"}
    {"messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."},
                  {"role": "assistant", "content": "..."}]}

`prompt`/`completion` is one user turn and the assistant's answer. In `messages` the last message is the
assistant's answer (the training target) and everything before it is the prompt. Both are rendered with
the model's chat template: the prompt with the generation prompt appended (what the generator is given at
rollout time), the response as what the template puts after it, ending with the EOS token (`<|im_end|>`
for the tiny model and Qwen3). The loss is taken on the response tokens only.

A bad record raises `DatasetFormatError` naming the file, the line (or row) and what is wrong. Nothing
is downloaded: paths are local.
"""

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forge_rl.data.sources import DataError, read_jsonl

ROLES = ("system", "user", "assistant", "tool")


class DatasetFormatError(DataError):
    """A dataset record that is not one of the accepted formats; the message names file and line."""


@dataclass(frozen=True)
class SFTExample:
    prompt_ids: list[int]
    response_ids: list[int]  # ends with the EOS token
    images: tuple[bytes, ...] = ()  # a vision-language model's: the images its prompt's image tokens stand for


def _messages_of(record: Any, where: str) -> list[dict[str, str]]:
    """Validate one record and return it as chat messages (the last one is the assistant's target)."""
    if not isinstance(record, dict):
        raise DatasetFormatError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or len(messages) < 2:
            raise DatasetFormatError(
                f"{where}: 'messages' must be a list of at least 2 messages (prompt turns, then the assistant's answer)"
            )
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise DatasetFormatError(
                    f"{where}: messages[{i}] must be an object with string 'role' and 'content', got {m!r:.120}"
                )
            if m["role"] not in ROLES:
                raise DatasetFormatError(f"{where}: messages[{i}] has role {m['role']!r}; expected one of {ROLES}")
        if messages[-1]["role"] != "assistant":
            raise DatasetFormatError(
                f"{where}: the last message must be the assistant's answer (the target), got role "
                f"{messages[-1]['role']!r}"
            )
        if not messages[-1]["content"]:
            raise DatasetFormatError(f"{where}: the assistant's answer (last message) is empty")
        return [{"role": m["role"], "content": m["content"]} for m in messages]
    if "prompt" in record or "completion" in record:
        for key in ("prompt", "completion"):
            if key not in record:
                raise DatasetFormatError(f"{where}: has 'prompt'/'completion' format but no {key!r}")
            if not isinstance(record[key], str):
                raise DatasetFormatError(f"{where}: {key!r} must be a string, got {type(record[key]).__name__}")
        if not record["completion"]:
            raise DatasetFormatError(f"{where}: 'completion' is empty")
        return [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": record["completion"]}]
    raise DatasetFormatError(f"{where}: expected keys 'prompt' and 'completion', or 'messages'; got {sorted(record)}")


def read_records(path: str | Path) -> list[tuple[str, list[dict[str, str]]]]:
    """(where, messages) for every record of a JSONL file or an HF dataset directory, validated."""
    path = Path(path).expanduser()
    if not path.exists():
        raise DatasetFormatError(
            f"dataset {path}: no such file or directory; give a .jsonl file, an HF dataset directory or 'arithmetic'"
        )
    if path.is_dir():
        return _read_hf_dir(path)
    try:
        rows = read_jsonl(path)  # the task reader's: JSON errors name the file and line
    except DataError as e:
        raise DatasetFormatError(_with_line(str(e))) from None
    out = [(_with_line(where), _messages_of(record, _with_line(where))) for where, record in rows]
    if not out:
        raise DatasetFormatError(f"{path}: no records (the file is empty)")
    return out


def _with_line(text: str) -> str:
    """ "file:N..." -> "file:N (line N)...", as SFT's messages name a line."""
    return re.sub(r"^(.*?:(\d+))(?=:|$)", r"\1 (line \2)", text, count=1)


def _read_hf_dir(path: Path) -> list[tuple[str, list[dict[str, str]]]]:
    try:
        import datasets
    except ImportError:
        raise ImportError(
            f"dataset {path} is a directory (an HF dataset saved with save_to_disk); reading it needs the "
            "'datasets' package: pip install datasets. Or pass a .jsonl file"
        ) from None
    try:
        ds = datasets.load_from_disk(str(path))
    except FileNotFoundError as e:
        raise DatasetFormatError(f"dataset {path}: not an HF dataset directory (save_to_disk format): {e}") from None
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise DatasetFormatError(f"dataset {path}: has splits {list(ds)}; SFT reads the 'train' split")
        ds = ds["train"]
    out = [(f"{path} row {i}", _messages_of(row, f"{path} row {i}")) for i, row in enumerate(ds)]
    if not out:
        raise DatasetFormatError(f"dataset {path}: no rows")
    return out


def tokenize_messages(tokenizer, messages: list[dict[str, str]]) -> SFTExample:
    """Render with the chat template: prompt = every turn but the last plus the generation prompt; response =
    what the template puts after it for the assistant's answer, up to and including the EOS token."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the model's tokenizer has no chat template; SFT renders prompts with it")
    eos = tokenizer.eos_token
    if eos is None or tokenizer.eos_token_id is None:
        raise ValueError("the model's tokenizer has no EOS token; responses must end with one")
    prompt_text = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
    full_text = tokenizer.apply_chat_template(messages, tokenize=False)
    answer = messages[-1]["content"]
    if full_text.startswith(prompt_text) and answer in full_text[len(prompt_text) :]:
        response_text = full_text[len(prompt_text) :]
        # cut after the EOS that ends the answer (templates add a newline or more after it)
        end = response_text.find(eos, response_text.find(answer) + len(answer))
        response_text = response_text[: end + len(eos)] if end >= 0 else response_text + eos
    else:  # a template whose generation prompt is not a prefix of the rendered answer
        response_text = answer + eos
    prompt_ids = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    response_ids = tokenizer(response_text, add_special_tokens=False)["input_ids"]
    if not response_ids or response_ids[-1] != tokenizer.eos_token_id:
        response_ids = list(response_ids) + [tokenizer.eos_token_id]
    return SFTExample(list(prompt_ids), list(response_ids))


def load_sft_dataset(path: str | Path, tokenizer, max_len: int | None = None) -> list[SFTExample]:
    """Read, validate and tokenise a local dataset. A record longer than `max_len` tokens is an error
    naming its line (the trainer cannot take it)."""
    examples = []
    for where, messages in read_records(path):
        ex = tokenize_messages(tokenizer, messages)
        if max_len is not None and len(ex.prompt_ids) + len(ex.response_ids) > max_len:
            raise DatasetFormatError(
                f"{where}: {len(ex.prompt_ids) + len(ex.response_ids)} tokens after the chat template; "
                f"the limit (the model's max_seq_len) is {max_len}"
            )
        examples.append(ex)
    return examples
