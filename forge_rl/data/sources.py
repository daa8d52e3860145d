"""Where a task's rows come from: local files, Hugging Face dataset directories, or a Python function.

    rows = read_rows("data/train.jsonl")                  # [(where, {"prompt": ..., "answer": ...}), ...]
    rows = read_rows("data/gsm8k", split="test")          # an HF dataset directory
    rows = read_rows("mypkg.tasks:rows", split="train")   # any function returning (or yielding) dicts

A source is one of
- a `.jsonl`, `.json` (an array of objects), `.parquet` or `.csv` file;
- a directory written by `datasets.save_to_disk` (read with `load_from_disk`), or a directory of data files
  that `datasets.load_dataset` understands (split names come from the file names, e.g. train.jsonl,
  test-00000.parquet);
- "package.module:function": called with `split=`, returning a list or an iterable of dicts. An endless
  iterator is allowed (a generated task); it is read lazily.

"reasoning_gym:NAME" names a reasoning-gym task instead (`is_reasoning_gym_source`): its rows and splits come from
the task's own settings (forge_rl/data/reasoning_gym.py), so `read_rows` refuses it.

`where` names the row for error messages: "file:line" for JSONL and CSV, "file row i" otherwise. Nothing is
downloaded: every path is local.
"""

import csv
import importlib
import inspect
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from forge_rl.errors import DataError

FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")
REASONING_GYM_PREFIX = "reasoning_gym:"  # task.source: reasoning_gym:basic_arithmetic
__all__ = [
    "DataError",
    "FILE_SUFFIXES",
    "REASONING_GYM_PREFIX",
    "is_callable_source",
    "is_reasoning_gym_source",
    "read_jsonl",
    "read_rows",
]


def is_reasoning_gym_source(source: str) -> bool:
    return source.startswith(REASONING_GYM_PREFIX)


def is_callable_source(source: str) -> bool:
    module, sep, attr = source.partition(":")
    return bool(
        sep and attr and module and "/" not in source and not Path(source).exists()
    ) and not is_reasoning_gym_source(source)


def read_rows(
    source: str, split: str | None = None, seed: int = 0
) -> list[tuple[str, dict]] | Iterator[tuple[str, dict]]:
    """Every row of `source` (a list), or an iterator for a function that yields rows lazily. A function gets
    `split` and `seed` as keyword arguments where it has parameters of those names."""
    if is_reasoning_gym_source(source):  # its rows depend on task.reasoning_gym, which only a task has
        raise DataError(f"data source {source!r}: a reasoning-gym task is a task.source of the RL apps (GRPO, PPO)")
    if is_callable_source(source):
        return _call_source(source, split, seed)
    path = Path(source).expanduser()
    if not path.exists():
        raise DataError(f"data source {source!r}: no such file or directory (or 'package.module:function')")
    if path.is_dir():
        return _read_hf_dir(path, split)
    if path.suffix not in FILE_SUFFIXES:
        raise DataError(
            f"data source {path}: unknown file type {path.suffix!r}; expected one of {FILE_SUFFIXES}, "
            "an HF dataset directory or 'package.module:function'"
        )
    if split is not None:
        raise DataError(
            f"data source {path}: a single file has no splits (split={split!r}); give the held-out "
            "rows as their own file or use held_out_fraction"
        )
    read = {".jsonl": read_jsonl, ".json": _read_json, ".parquet": _read_parquet, ".csv": _read_csv}[path.suffix]
    try:
        rows = read(path)
    except UnicodeDecodeError as e:
        raise DataError(
            f"data source {path}: not UTF-8 text ({e.reason} at byte {e.start}); save it as UTF-8"
        ) from None
    except csv.Error as e:  # a NUL byte, a field larger than csv's limit
        raise DataError(f"data source {path}: not a readable CSV file ({e})") from None
    except OSError as e:  # unreadable: permissions, a broken mount
        raise DataError(f"data source {path}: cannot be read ({e.strerror or e})") from None
    if not rows:
        raise DataError(f"data source {path}: no rows (the file is empty)")
    return rows


def read_jsonl(path: Path) -> list[tuple[str, dict]]:
    rows = []
    with path.open(encoding="utf-8-sig") as f:  # -sig: a byte-order mark is not part of the first row
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            rows.append((where, _object(row, where)))
    return rows


def _read_json(path: Path) -> list[tuple[str, dict]]:
    try:
        data = json.loads(path.read_text(encoding="utf-8-sig"))
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a JSON array of objects (or use .jsonl, one object per line)")
    return [(f"{path} row {i}", _object(row, f"{path} row {i}")) for i, row in enumerate(data)]


def _read_parquet(path: Path) -> list[tuple[str, dict]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow's errors vary by what is wrong with the file
        raise DataError(f"{path}: not a readable Parquet file ({type(e).__name__}: {e})") from None
    return [(f"{path} row {i}", row) for i, row in enumerate(table.to_pylist())]


def _read_csv(path: Path) -> list[tuple[str, dict]]:
    # -sig: a byte-order mark (Excel writes one) is not part of the first column's name
    with path.open(encoding="utf-8-sig", newline="") as f:
        reader = csv.DictReader(f)
        rows = []
        for row in reader:
            where = f"{path}:{reader.line_num}"
            if None in row:  # more fields than the header has names
                raise DataError(f"{where}: {len(row) - 1 + len(row[None])} fields, the header has {len(row) - 1}")
            rows.append((where, dict(row)))
    return rows


def _read_hf_dir(path: Path, split: str | None) -> list[tuple[str, dict]]:
    import datasets

    saved = (path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists()
    try:
        ds = datasets.load_from_disk(str(path)) if saved else datasets.load_dataset(str(path))
    except Exception as e:
        raise DataError(
            f"data source {path}: not an HF dataset directory (save_to_disk) nor a directory of data "
            f"files load_dataset reads ({type(e).__name__}: {e})"
        ) from None
    if isinstance(ds, datasets.DatasetDict):
        name = split or ("train" if "train" in ds else None)
        if name not in ds:
            raise DataError(f"data source {path}: has splits {sorted(ds)}; choose one with split (asked for {split!r})")
        ds = ds[name]
    elif split is not None and split != "train":
        raise DataError(f"data source {path}: a single dataset without splits (asked for split={split!r})")
    return [(f"{path} row {i}", row) for i, row in enumerate(ds)]


def _call_source(source: str, split: str | None, seed: int) -> list[tuple[str, dict]] | Iterator[tuple[str, dict]]:
    module, _, attr = source.partition(":")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise DataError(f"data source {source!r}: cannot import it ({e})") from None
    params = inspect.signature(fn).parameters
    if split is not None and "split" not in params:
        raise DataError(f"data source {source!r} takes no 'split' argument (asked for split={split!r})")
    kwargs = {k: v for k, v in (("split", split), ("seed", seed)) if k in params and v is not None}
    result = fn(**kwargs)
    if isinstance(result, (list, tuple)):
        return [(f"{source} row {i}", _object(row, f"{source} row {i}")) for i, row in enumerate(result)]
    if not isinstance(result, Iterable):
        raise DataError(
            f"data source {source!r} returned {type(result).__name__}; expected a list or an iterable of dicts"
        )
    return ((f"{source} row {i}", _object(row, f"{source} row {i}")) for i, row in enumerate(result))


def _object(row: Any, where: str) -> dict:
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object (a dict of columns), got {type(row).__name__}")
    return row
