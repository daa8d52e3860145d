"""Tasks from the user's data: every source format, column mapping, splits, positions, rendering and errors
that name the row and the column. Unit tests on data the tests write; no actors."""

import csv
import json

import pytest

from forge_rl.data.sources import DataError, read_rows
from forge_rl.data.task import TaskConfig, TaskRows, render, to_example

ROWS = [{"question": f"What is {i}+{i}?", "answer": 2 * i, "unit": "cm", "level": i % 3} for i in range(20)]


def write_all_formats(tmp_path, rows=ROWS) -> dict[str, str]:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    paths = {}
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "t.json").write_text(json.dumps(rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "t.parquet")
    with (tmp_path / "t.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(rows), "test": datasets.Dataset.from_list(rows[:5])}
    ).save_to_disk(str(tmp_path / "saved"))
    files = tmp_path / "files"  # a directory of data files, split names from file names (load_dataset)
    files.mkdir()
    (files / "train.jsonl").write_text((tmp_path / "t.jsonl").read_text())
    (files / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:5]))
    for name in ("t.jsonl", "t.json", "t.parquet", "t.csv", "saved", "files"):
        paths[name] = str(tmp_path / name)
    return paths


def test_every_source_format_gives_the_same_examples(tmp_path):
    paths = write_all_formats(tmp_path)
    cfg = dict(prompt_column="question", answer_column="answer", shuffle=False)
    for name, path in paths.items():
        rows = TaskRows(TaskConfig(source=path, **cfg))
        examples = [rows.next() for _ in range(20)]
        assert [e.prompt for e in examples] == [r["question"] for r in ROWS], name
        assert [e.answer for e in examples] == [str(r["answer"]) for r in ROWS], name  # numbers become strings
        # every other column reaches rewards; CSV has no types, so its values are strings
        unit_levels = [(e.columns["unit"], str(e.columns["level"])) for e in examples]
        assert unit_levels == [("cm", str(r["level"])) for r in ROWS], name
        assert "question" not in examples[0].columns and examples[0].columns["answer"] == "0"
    # split names: the held-out split of an HF directory
    for name in ("saved", "files"):
        rows = TaskRows(TaskConfig(source=paths[name], held_out="test", **cfg))
        assert [e.prompt for e in rows.held_out()] == [r["question"] for r in ROWS[:5]]


def test_function_sources_listed_and_endless(tmp_path):
    rows = TaskRows(TaskConfig(source="tests.support.tasks_for_tests:listed_rows", held_out="test", shuffle=False))
    assert [rows.next().prompt for _ in range(3)] == ["train 0", "train 1", "train 2"]
    assert [e.prompt for e in rows.held_out()] == ["test 0", "test 1", "test 2"]
    endless = TaskRows(TaskConfig(source="tests.support.tasks_for_tests:streamed_rows"), seed=7)
    assert [endless.next().prompt for _ in range(3)] == ["q7-0", "q7-1", "q7-2"]
    endless.seek(1000)
    assert endless.next().prompt == "q7-1000" and endless.position == 1001
    with pytest.raises(DataError, match="held_out_fraction.*yields rows lazily"):
        TaskRows(TaskConfig(source="tests.support.tasks_for_tests:streamed_rows", held_out_fraction=0.1))
    with pytest.raises(DataError, match="returned int"):
        TaskRows(TaskConfig(source="tests.support.tasks_for_tests:not_rows"))
    with pytest.raises(DataError, match="cannot import"):
        TaskRows(TaskConfig(source="tests.support.tasks_for_tests:missing"))


def test_builtin_arithmetic_task_is_the_same_stream_and_held_out_set():
    from forge_rl.data.arithmetic import held_out_problems, training_problems

    rows = TaskRows(TaskConfig(source="arithmetic"), seed=3)
    assert [(e.prompt, e.answer) for e in (rows.next() for _ in range(50))] == [
        (p.question, p.answer) for p in training_problems(50, 3)
    ]
    assert [(e.prompt, e.answer) for e in rows.held_out()] == [(p.question, p.answer) for p in held_out_problems(500)]


def test_epochs_reshuffle_and_positions_resume(tmp_path):
    paths = write_all_formats(tmp_path)
    cfg = TaskConfig(source=paths["t.jsonl"], prompt_column="question")
    rows = TaskRows(cfg, seed=1)
    seen = [rows.next().prompt for _ in range(45)]
    assert sorted(seen[:20]) == sorted(r["question"] for r in ROWS)  # an epoch is every row once
    assert sorted(seen[20:40]) == sorted(seen[:20]) and seen[20:40] != seen[:20]  # reshuffled
    assert rows.epoch == 2
    resumed = TaskRows(cfg, seed=1)
    resumed.seek(30)
    assert [resumed.next().prompt for _ in range(15)] == seen[30:]
    other_seed = TaskRows(cfg, seed=2)
    assert [other_seed.next().prompt for _ in range(20)] != seen[:20]


def test_held_out_fraction_is_disjoint_and_fixed_by_split_seed(tmp_path):
    paths = write_all_formats(tmp_path)
    cfg = TaskConfig(source=paths["t.jsonl"], prompt_column="question", held_out_fraction=0.25)
    a, b = TaskRows(cfg, seed=0), TaskRows(cfg, seed=5)
    held = {e.prompt for e in a.held_out()}
    assert len(held) == 5 and held == {e.prompt for e in b.held_out()}  # the run's seed does not move it
    trained = {a.next().prompt for _ in range(40)}
    assert len(trained) == 15 and not trained & held
    moved = TaskRows(
        TaskConfig(source=paths["t.jsonl"], prompt_column="question", held_out_fraction=0.25, split_seed=1)
    )
    assert {e.prompt for e in moved.held_out()} != held
    held_file = TaskRows(TaskConfig(source=paths["t.jsonl"], prompt_column="question", held_out=paths["t.csv"]))
    assert len(held_file.held_out()) == 20


@pytest.mark.parametrize(
    "template, says",
    [
        ("{% for m in messages %}", "TemplateSyntaxError: Unexpected end of template"),
        ("{% for m in messages %}{{ m.nope.nope }}{% endfor %}", "UndefinedError"),
    ],
)
def test_a_chat_template_that_does_not_render_is_one_line_naming_the_example_and_the_fix(template, says):
    from transformers import AutoTokenizer

    from forge_rl.models import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("tiny-warm"))
    tokenizer.chat_template = template
    example = to_example({"prompt": "2+3=", "answer": "5"}, "row", 7, TaskConfig())
    with pytest.raises(DataError) as e:
        render(tokenizer, example, TaskConfig())
    message = str(e.value)
    assert "\n" not in message and says in message and f"example {example.id}" in message, message
    assert "task.chat_template: false" in message


def test_chat_messages_system_prompt_few_shot_and_rendering():
    from transformers import AutoTokenizer

    from forge_rl.models import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("tiny-warm"))
    cfg = TaskConfig(system_prompt="Answer with digits.", few_shot=[{"prompt": "1+1=", "answer": "2"}])
    example = to_example({"prompt": "2+3=", "answer": "5"}, "row", 0, cfg)
    assert [m["role"] for m in example.messages] == ["system", "user", "assistant", "user"]
    text = render(tokenizer, example, cfg)
    assert text.startswith("<|im_start|>system\nAnswer with digits.<|im_end|>")
    assert text.endswith("<|im_start|>user\n2+3=<|im_end|>\n<|im_start|>assistant\n")
    # a row's own system turn stays first and wins over task.system_prompt
    chat = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+3="}]
    example = to_example({"prompt": chat, "answer": "5"}, "row", 0, cfg)
    assert [m["content"] for m in example.messages] == ["Be terse.", "1+1=", "2", "2+3="]
    plain = TaskConfig(chat_template=False, system_prompt="Add.", few_shot=[{"prompt": "1+1=", "answer": "2"}])
    assert (
        render(tokenizer, to_example({"prompt": "2+3=", "answer": 5}, "row", 0, plain), plain)
        == "Add.\n\n1+1=2\n\n2+3="
    )


def test_bad_data_is_named_by_file_line_and_column(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": \n')
    with pytest.raises(DataError, match=rf"{bad}:2: not valid JSON"):
        TaskRows(TaskConfig(source=str(bad)))
    cases = [
        (
            {"question": "a", "answer": "1"},
            r"row.jsonl:3: no column 'prompt' \(task.prompt_column\); the row has \['answer', 'question'\]",
        ),
        ({"prompt": "a"}, r"no column 'answer' \(task.answer_column\)"),
        ({"prompt": "a", "answer": None}, r"column 'answer' \(task.answer_column\) must be a string or a number"),
        ({"prompt": "", "answer": "1"}, "column 'prompt' .* is empty"),
        ({"prompt": [{"role": "robot", "content": "x"}], "answer": "1"}, r"prompt'.*\[0\] has role 'robot'"),
        ({"prompt": 7, "answer": "1"}, "must be a string or a non-empty list of chat messages"),
        ({"prompt": "a", "answer": "1", "completions": "x"}, "column 'completions' would clash"),
    ]
    for row, message in cases:
        path = tmp_path / "row.jsonl"
        path.write_text("\n".join([json.dumps({"prompt": "ok", "answer": "1"})] * 2 + [json.dumps(row)]) + "\n")
        with pytest.raises(DataError, match=message):
            TaskRows(TaskConfig(source=str(path)))
    csv_path = tmp_path / "wide.csv"
    csv_path.write_text("prompt,answer\na,1\nb,2,extra\n")
    with pytest.raises(DataError, match=rf"{csv_path}:3: 3 fields, the header has 2"):
        TaskRows(TaskConfig(source=str(csv_path)))
    with pytest.raises(DataError, match="no such file or directory"):
        read_rows(str(tmp_path / "missing.jsonl"))
    with pytest.raises(DataError, match="a single file has no splits"):
        read_rows(str(bad), split="test")
    with pytest.raises(DataError, match="unknown file type '.txt'"):
        (tmp_path / "x.txt").write_text("hi")
        read_rows(str(tmp_path / "x.txt"))
    with pytest.raises(ValueError, match="task.held_out_fraction must be in"):
        TaskConfig(held_out_fraction=1.5)


def test_a_byte_order_mark_is_not_part_of_the_first_column(tmp_path):
    """Excel and Notepad save UTF-8 with a byte-order mark; the header's first name is still 'prompt'."""
    (tmp_path / "bom.csv").write_bytes("prompt,answer\n1+1=,2\n".encode("utf-8-sig"))
    (tmp_path / "bom.jsonl").write_bytes('{"prompt": "1+1=", "answer": "2"}\n'.encode("utf-8-sig"))
    (tmp_path / "bom.json").write_bytes('[{"prompt": "1+1=", "answer": "2"}]'.encode("utf-8-sig"))
    for name in ("bom.csv", "bom.jsonl", "bom.json"):
        rows = TaskRows(TaskConfig(source=str(tmp_path / name)))
        assert rows.examples[0].prompt == "1+1=" and rows.examples[0].answer == "2", name
    (tmp_path / "latin1.jsonl").write_bytes('{"prompt": "caf\xe9", "answer": "1"}\n'.encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1.jsonl: not UTF-8 text"):
        TaskRows(TaskConfig(source=str(tmp_path / "latin1.jsonl")))


def test_math_answers_match_in_equivalent_forms():
    from forge_rl.rewards.math import math_answer, math_format

    cases = [  # (completion, reference, correct)
        ("The answer is \\boxed{\\frac{1}{2}}.", "0.5", 1.0),
        ("so it is 1/2", "\\frac{1}{2}", 1.0),
        ("\\boxed{\\dfrac{3}{4}}", "3/4", 1.0),
        ("Total length: 12 cm", "12", 1.0),
        ("x = 3", "3", 1.0),
        ("50%", "0.5", 1.0),
        ("She pays 1,000 dollars.\n#### 1,000", "Natalia sold 48/2 = 24 clips.\n#### 1000", 1.0),
        ("\\boxed{2\\sqrt{2}}", "$\\boxed{\\sqrt{8}}$", 1.0),
        ("\\boxed{(1,2)}", "(1,2)", 1.0),
        ("\\boxed{8}\n#### 7", "8", 1.0),  # \boxed{} is the final answer when both are given
        ("#### 41", "#### 42", 0.0),
        ("\\boxed{0.333}", "\\frac{1}{3}", 0.0),
        ("I do not know", "7", 0.0),
    ]
    got = math_answer([""] * len(cases), [c for c, _, _ in cases], answer=[a for _, a, _ in cases])
    assert got == [want for *_, want in cases]
    assert math_format(
        [""] * 4, ["\\boxed{1}", "work\n#### 3", "3", "\\boxed{1}"], finish_reason=["stop", "stop", "stop", "length"]
    ) == [1.0, 1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="cannot read the reference answer"):
        math_answer([""], ["1"], answer=["   "])


def test_columns_are_renamed_for_the_rewards_and_a_missing_one_is_named():
    cfg = TaskConfig(source="unused", prompt_column="text", answer_column=None, columns={"test_list": "tests"})
    row = {"text": "Write f", "test_list": ["assert f(1) == 2"], "code": "def f(x): return x + 1"}
    example = to_example(row, "mbpp.jsonl:1", 0, cfg)
    assert example.columns == {"tests": ["assert f(1) == 2"], "code": "def f(x): return x + 1"}
    assert example.answer is None
    with pytest.raises(DataError, match=r"mbpp.jsonl:2: no column 'test_list' \(task.columns maps it to 'tests'\)"):
        to_example({"text": "Write g"}, "mbpp.jsonl:2", 1, cfg)
    with pytest.raises(DataError, match="maps 'test_list' to 'completions'"):
        to_example(
            row,
            "mbpp.jsonl:1",
            0,
            TaskConfig(prompt_column="text", answer_column=None, columns={"test_list": "completions"}),
        )
