"""SFT: the app end to end on the tiny model (loss falls, outputs written, resume continues at the saved
step with the same losses, Ctrl-C saves a checkpoint), the dataset loader and its errors, the held-out
split, and the shipped warm-start model's greedy held-out accuracy through a vLLM generator service."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from transformers import AutoTokenizer

from forge_rl.recipes.sft import SFTConfig, main
from forge_rl.config import load_config
from forge_rl.data.arithmetic import chat_prompt, held_out_problems, problems, training_problems
from forge_rl.data.jsonl import DatasetFormatError, load_sft_dataset, tokenize_messages
from tests.conftest import REPO, TINY_MODEL, started_in_the_background

# The documented band of tiny-warm's greedy accuracy on the held-out prompts (docs/sft.md).
WARM_BAND = (0.25, 0.50)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TINY_MODEL)


def sft_config(tmp_path, *overrides):
    return load_config(
        SFTConfig,
        REPO / "configs/sft/tiny.yaml",
        [f"output_dir={tmp_path}", "batch_size=64", "eval_size=0", "export_dir=", *overrides],
    )


def read_metrics(path):
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


# ---- the app ---------------------------------------------------------------------------------------


def test_sft_smoke_loss_falls_and_outputs_are_written(tmp_path):
    summary = asyncio.run(main(sft_config(tmp_path, "steps=8", "checkpoint_every=4", f"export_dir={tmp_path}/hf")))
    losses = [r["train/loss"] for r in read_metrics(tmp_path) if "train/loss" in r]
    assert len(losses) == 8 and summary["steps"] == 8 and not summary["interrupted"]
    assert losses[-1] < 0.7 * losses[0], losses
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    assert (tmp_path / "config.yaml").read_text().startswith("model: tiny")
    assert (tmp_path / "loss.png").stat().st_size > 1000
    # the timeline: each step's trainer span and the checkpoints, a PNG, and the summary's busy fractions
    trace = json.loads((tmp_path / "timeline.json").read_text())["traceEvents"]
    assert sum(e["name"] == "train step" for e in trace if e["ph"] == "X") == 8
    assert sum(e["name"] == "checkpoint" for e in trace if e["ph"] == "X") == 2
    assert (tmp_path / "timeline.png").stat().st_size > 5_000 and 0 < summary["busy_fraction"]["trainer"] < 1
    assert {p.name for p in (tmp_path / "checkpoints").iterdir()} == {"step-4", "step-8"}
    from safetensors import safe_open

    assert {p.name for p in (tmp_path / "hf").iterdir()} >= {p.name for p in TINY_MODEL.iterdir()}
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" in f.keys()  # like the shipped models (vLLM's live reload wants it)


def test_resume_continues_at_the_saved_step(tmp_path, tokenizer):
    """A JSONL dataset, 4 steps with checkpoints at 2 and 4; drop step-4 and resume: steps 3 and 4 are
    trained again from the step-2 state and give the same losses."""
    import shutil

    data = tmp_path / "train.jsonl"
    data.write_text(
        "".join(
            json.dumps({"prompt": p.question, "completion": p.answer}) + "\n" for p in training_problems(100, seed=3)
        )
    )
    run = tmp_path / "run"
    args = [f"dataset={data}", "batch_size=32", "checkpoint_every=2"]
    asyncio.run(main(sft_config(run, "steps=4", *args)))
    first = read_metrics(run)
    shutil.rmtree(run / "checkpoints" / "step-4")
    summary = asyncio.run(main(sft_config(run, "steps=4", "resume=true", *args)))
    assert summary["start_step"] == 2 and summary["trained_steps"] == 2
    again = read_metrics(run)
    assert [r["step"] for r in again] == [1, 2, 3, 4]  # the log continues; nothing past step 2 is kept twice
    for a, b in zip(first, again):
        assert abs(a["train/loss"] - b["train/loss"]) < 1e-5, (a, b)


def test_ctrl_c_saves_a_checkpoint_and_exits(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "apps.sft.main",
            "--config",
            "configs/sft/tiny.yaml",
            f"output_dir={tmp_path}",
            "steps=100000",
            "batch_size=32",
            "eval_size=0",
            "export_dir=",
            "checkpoint_every=0",
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        preexec_fn=started_in_the_background,  # SIGINT inherited ignored, as under nohup or `cmd &`
    )
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            metrics = tmp_path / "metrics.jsonl"
            if metrics.is_file() and len(metrics.read_text().splitlines()) >= 3:
                break
            time.sleep(0.5)
        else:
            pytest.fail("the SFT app did not reach step 3")
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the whole process group
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["interrupted"] and summary["steps"] >= 3
    assert (tmp_path / "checkpoints" / f"step-{summary['steps']}" / ".metadata").is_file()
    assert read_metrics(tmp_path)[-1]["step"] == summary["steps"]  # the step in flight finished and was logged


# ---- data ------------------------------------------------------------------------------------------


def test_training_problems_never_contain_held_out_questions():
    held = {p.question for p in held_out_problems(500)}
    assert len(held) == 500 and held_out_problems(100) == held_out_problems(500)[:100]
    for seed in (0, 1, 3):
        train = training_problems(20_000, seed)
        assert not held & {p.question for p in train}
        assert training_problems(50, seed) == train[:50]  # prefix-stable, so resumable
    assert any(p.question in held for p in problems(20_000, 0))  # the unfiltered stream would leak
    with pytest.raises(ValueError, match="500"):
        held_out_problems(501)


def test_prompt_completion_tokenises_like_the_generator_sees_it(tokenizer):
    p = held_out_problems(1)[0]
    ex = tokenize_messages(
        tokenizer, [{"role": "user", "content": p.question}, {"role": "assistant", "content": p.answer}]
    )
    assert ex.prompt_ids == tokenizer(chat_prompt(tokenizer, p), add_special_tokens=False)["input_ids"]
    assert ex.response_ids[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>") == tokenizer.eos_token_id
    assert tokenizer.decode(ex.response_ids[:-1]) == p.answer


def test_jsonl_and_hf_dir_formats(tmp_path, tokenizer):
    rows = [
        {"prompt": "1+2=", "completion": "3"},
        {
            "messages": [
                {"role": "system", "content": "add"},
                {"role": "user", "content": "2+2="},
                {"role": "assistant", "content": "4"},
            ]
        },
    ]
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(rows[0]) + "\n\n" + json.dumps(rows[1]) + "\n")  # blank lines are skipped
    examples = load_sft_dataset(path, tokenizer)
    assert len(examples) == 2
    assert tokenizer.decode(examples[1].prompt_ids).startswith("<|im_start|>system\nadd<|im_end|>")
    assert tokenizer.decode(examples[1].response_ids) == "4<|im_end|>"
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list([rows[0]]).save_to_disk(str(tmp_path / "hf"))
    assert load_sft_dataset(tmp_path / "hf", tokenizer) == examples[:1]


@pytest.mark.parametrize(
    "line, why",
    [
        ('{"prompt": "1+2=", "completion": "3"', "not valid JSON"),
        ('{"prompt": "1+2="}', "no 'completion'"),
        ('{"question": "1+2=", "answer": "3"}', "expected keys 'prompt' and 'completion', or 'messages'"),
        (
            '{"messages": [{"role": "user", "content": "1+2="}, {"role": "user", "content": "3"}]}',
            "last message must be the assistant's answer",
        ),
        ('{"prompt": "1+2=", "completion": 3}', "'completion' must be a string"),
        ("[1, 2]", "expected a JSON object"),
    ],
)
def test_a_bad_line_is_named_with_file_and_line_number(tmp_path, tokenizer, line, why):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "1+1=", "completion": "2"}\n{"prompt": "2+1=", "completion": "3"}\n' + line + "\n")
    with pytest.raises(DatasetFormatError) as e:
        load_sft_dataset(path, tokenizer)
    assert f"{path}:3 (line 3)" in str(e.value) and why in str(e.value), str(e.value)


def test_too_long_example_is_named(tmp_path, tokenizer):
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"prompt": "1" * 600, "completion": "2"}) + "\n")
    with pytest.raises(DatasetFormatError, match=r"long.jsonl:1 \(line 1\): \d+ tokens .* 512"):
        load_sft_dataset(path, tokenizer, max_len=512)


# ---- the shipped warm start ------------------------------------------------------------------------


def test_tiny_warm_greedy_accuracy_is_in_the_documented_band(tokenizer):
    from forge_rl.actors.generator import Generator
    from forge_rl.runtime import provisioned
    from forge_rl.loop.eval import greedy_accuracy
    from forge_rl.models import resolve_model_path

    async def body():
        async with provisioned():
            gen = await Generator.options(replicas=1).as_service(
                resolve_model_path("tiny-warm"), engine_args=dict(max_model_len=128)
            )
            return await greedy_accuracy(gen, tokenizer, held_out_problems(100))

    result = asyncio.run(asyncio.wait_for(body(), 300))
    assert result["n"] == 100 and result["format_ok"] > 0.9
    assert WARM_BAND[0] <= result["accuracy"] <= WARM_BAND[1], result


def test_sft_of_a_vision_language_model_on_its_tasks_images(tmp_path):
    """`dataset: task` on the digit-sum task with tiny-vlm (configs/sft/tiny_vlm.yaml): each row's image goes with
    its tokens to the trainer's vision tower, the loss falls, and the export is a whole Idefics3 (vision tower,
    connector, processor files) that transformers loads with every weight."""
    import torch
    from transformers import Idefics3ForConditionalGeneration

    cfg = load_config(
        SFTConfig,
        REPO / "configs/sft/tiny_vlm.yaml",
        [f"output_dir={tmp_path}", "steps=4", "batch_size=16", "eval_size=0", f"export_dir={tmp_path}/hf"],
    )
    summary = asyncio.run(main(cfg))
    losses = [r["train/loss"] for r in read_metrics(tmp_path) if "train/loss" in r]
    assert len(losses) == 4 and losses[-1] < 0.8 * losses[0], losses
    assert {"preprocessor_config.json", "processor_config.json"} <= {p.name for p in (tmp_path / "hf").iterdir()}
    model, info = Idefics3ForConditionalGeneration.from_pretrained(
        summary["export_dir"], dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    shipped = Idefics3ForConditionalGeneration.from_pretrained(REPO / "forge_rl/models/tiny_vlm", dtype=torch.float32)
    tower = "model.vision_model.encoder.layers.0.mlp.fc1.weight"
    assert not torch.equal(model.state_dict()[tower], shipped.state_dict()[tower])  # the tower trained too
