"""Warm-start the embedded tiny VLM on the digit images, so that GRPO starts from a model that sometimes reads the
two digits right, and `make demo-vlm` shows it improving.

    python -m forge_rl.models.warm_tiny_vlm [--out forge_rl/models/tiny_vlm] [--target 0.25]

From build_tiny_vlm's random weights (written to `out` first), on training images only (never a held-out layout):

1. **Seeing**: the vision tower and connector learn the two digits through a linear probe over the image's
   tokens (thrown away afterwards). SFT cannot start from a random tower: attention that is still uniform
   averages the patch features, which loses the digits' shapes, and the loss stays at the answers' marginal.
2. **Answering**: SFT of the whole model on `digit_read`'s rows ("Read the two digits.", rendered as forge_rl
   renders them: the SFT app's `dataset: task`), stopped once held-out greedy accuracy reaches `target`, so GRPO
   has room to improve it. (SFT on `digit_sum` from the same tower stayed at the sums' marginal for 250 steps:
   a random language model has the addition table to learn besides.)

Prints its progress; takes ~10 minutes on 2 CPU cores. Seeded, but not bit for bit across machines (CPU kernels
sum in a thread-count-dependent order); the processor and config files are build_tiny_vlm's, unchanged.
"""

import argparse
import random
import time
from pathlib import Path

import torch

from forge_rl.models.build_tiny_vlm import DEFAULT_OUT, IMAGE_TOKENS, build

SEED = 0
SEE_STEPS, SEE_LR, SEE_TARGET = 4000, 1e-3, 0.9  # stage 1: at most, Adam's rate, both digits right
SFT_STEPS, SFT_LR = 3000, 1e-3  # stage 2: at most
TASK = "digit_read"  # the SFT stage's task (forge_rl/data/digit_sum.py)
BATCH = 64
EVAL_EVERY = 50
EVAL_ROWS = 200  # held-out rows scored by teacher-forced greedy exact match


def load(out: Path, task: str = TASK):
    """The HF model, its processor, an SFT source of the task's training rows and its first held-out rows."""
    from transformers import AutoTokenizer, Idefics3ForConditionalGeneration

    from forge_rl.data.sft_sources import TaskSource
    from forge_rl.data.task import TaskConfig, TaskRows
    from forge_rl.data.vision import load_processor

    model = Idefics3ForConditionalGeneration.from_pretrained(str(out)).float()
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    source = TaskSource(TaskConfig(source=task), tokenizer, seed=SEED, max_len=None)
    held_out = [source.tokenised(row) for row in TaskRows(TaskConfig(source=task)).held_out()[:EVAL_ROWS]]
    return model, load_processor(out), source, held_out


def pixels(processor, examples) -> dict:
    """The image processor's tensors for each example's one image."""
    from forge_rl.data.images import load_image

    images = [[load_image(ex.images[0], "warm_tiny_vlm")] for ex in examples]
    return dict(processor.image_processor(images, return_tensors="pt"))


def image_tokens(model, inputs: dict) -> torch.Tensor:
    """The connector's output: (batch, IMAGE_TOKENS, text width), what the language model reads."""
    return model.model.get_image_features(inputs["pixel_values"], inputs["pixel_attention_mask"]).pooler_output


def digits(layouts) -> torch.Tensor:
    return torch.tensor([[layout.left.value, layout.right.value] for layout in layouts])


def train_seeing(model, processor) -> None:
    """Stage 1: tower and connector, through a linear probe from the image tokens to both digits."""
    from forge_rl.data import digit_sum

    probe = torch.nn.Linear(IMAGE_TOKENS * model.config.text_config.hidden_size, 20)
    params = [*model.model.vision_model.parameters(), *model.model.connector.parameters(), *probe.parameters()]
    optimizer = torch.optim.AdamW(params, lr=SEE_LR, weight_decay=0.0)
    train, held = digit_sum.iter_layouts(SEED, held_out=False), digit_sum.iter_layouts(digit_sum.HELD_OUT_SEED, True)
    held = [next(held) for _ in range(EVAL_ROWS)]
    held_inputs = _layout_pixels(processor, held)
    for step in range(SEE_STEPS):
        layouts = [next(train) for _ in range(BATCH)]
        logits = probe(image_tokens(model, _layout_pixels(processor, layouts)).flatten(1)).view(BATCH * 2, 10)
        loss = torch.nn.functional.cross_entropy(logits, digits(layouts).flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if (step + 1) % EVAL_EVERY == 0:
            with torch.no_grad():
                guess = probe(image_tokens(model, held_inputs).flatten(1)).view(-1, 2, 10).argmax(-1)
            both = (guess == digits(held)).all(-1).float().mean().item()
            print(f"seeing step {step + 1}: loss {loss.item():.3f}, held-out both digits right {both:.1%}", flush=True)
            if both >= SEE_TARGET:
                return


def _layout_pixels(processor, layouts) -> dict:
    from forge_rl.data import digit_sum

    return dict(processor.image_processor([[digit_sum.draw(layout)] for layout in layouts], return_tensors="pt"))


def sft_batch(processor, examples, pad_id: int) -> dict:
    """Right-padded input ids with labels on the response tokens only, and the images' pixels."""
    width = max(len(ex.prompt_ids) + len(ex.response_ids) for ex in examples)
    ids = torch.full((len(examples), width), pad_id)
    labels = torch.full((len(examples), width), -100)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, ex in enumerate(examples):
        row = ex.prompt_ids + ex.response_ids
        ids[i, : len(row)], mask[i, : len(row)] = torch.tensor(row), 1
        labels[i, len(ex.prompt_ids) : len(row)] = torch.tensor(ex.response_ids)
    return dict(input_ids=ids, attention_mask=mask, labels=labels, **pixels(processor, examples))


def greedy_accuracy(model, batch: dict) -> float:
    """Teacher-forced: a row is right when every response token is the argmax, which is what greedy decoding
    samples for it (the answer and its end-of-turn token)."""
    with torch.no_grad():
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    guess, labels = logits[:, :-1].argmax(-1), batch["labels"][:, 1:]
    return ((guess == labels) | (labels == -100)).all(-1).float().mean().item()


def train_answers(model, processor, source, held_out, target: float) -> float:
    """Stage 2: SFT of the whole model until held-out greedy accuracy reaches `target`; returns the last one."""
    pad_id = model.config.text_config.pad_token_id
    held_batch = sft_batch(processor, held_out, pad_id)
    optimizer = torch.optim.AdamW(model.parameters(), lr=SFT_LR, weight_decay=0.0)
    accuracy = greedy_accuracy(model, held_batch)
    for step in range(SFT_STEPS):
        if accuracy >= target:
            break
        batch = sft_batch(processor, [source.example(step * BATCH + i) for i in range(BATCH)], pad_id)
        loss = model(**batch).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if (step + 1) % (EVAL_EVERY // 2) == 0:  # finer: SFT of the answers moves fast once the tower reads
            accuracy = greedy_accuracy(model, held_batch)
            print(
                f"answer step {step + 1}: loss {loss.item():.3f}, held-out greedy accuracy {accuracy:.1%}", flush=True
            )
    return accuracy


def warm(out: Path = DEFAULT_OUT, target: float = 0.25) -> float:
    """Build tiny-vlm into `out`, warm-start its weights, and save them over the random ones."""
    from safetensors.torch import save_file

    build(out)
    torch.manual_seed(SEED)
    random.seed(SEED)
    model, processor, source, held_out = load(out)
    started = time.monotonic()
    train_seeing(model, processor)
    accuracy = train_answers(model, processor, source, held_out, target)
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    print(f"wrote {out}: held-out greedy accuracy {accuracy:.1%} after {time.monotonic() - started:.0f} s")
    return accuracy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--target", type=float, default=0.25, help="held-out greedy accuracy to stop SFT at")
    args = parser.parse_args()
    warm(args.out, args.target)


if __name__ == "__main__":
    main()
