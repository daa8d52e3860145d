"""Train the embedded tiny reward model: a classifier of "the completion is the correct sum" (forge_rl/models/tiny_rm).

    python -m forge_rl.models.build_tiny_rm [--out forge_rl/models/tiny_rm] [--steps 1000]

A `Qwen3ForSequenceClassification` with two labels (label 1: the completion is the right sum; the reward model
actor's reward is p(label 1)) whose body starts from tiny-warm's weights (the embedded tiny model's architecture,
after SFT on addition) and whose score head starts at zero. It is trained on the addition task's training problems
(forge_rl/data/arithmetic.py: never a held-out question), each posed as the chat the policy sees with one
completion: the right sum (a positive) or a corrupted one (a negative: a digit changed, dropped or added, the sum off
by a little, digits swapped, junk after the sum, no number). Half the examples are positives. It never sees a
model's samples, only the task's data.

A right/wrong label per example alone teaches the body to add slowly, so the body also gets a language-model loss
on the right sums' tokens (the tied embeddings as its output layer, weight --lm-weight): it keeps learning to add
from every digit, and the classifier learns to compare. Only the classifier is saved (its accuracy and build time:
docs/tiny_model.md).

Deterministic: fixed seeds for the data, the head and the batches, and a fixed thread count (--threads); the same
machine rebuilds the same weights. Prints its held-out accuracy: on corrupted held-out answers like the training
data, and on tiny-warm's own samples for held-out questions (labelled by exact match), which are what GRPO asks it
to score.
"""

import argparse
import random
import time
from pathlib import Path

import torch

from forge_rl.data.arithmetic import Problem, held_out_problems, iter_training_problems

DEFAULT_OUT = Path(__file__).parent / "tiny_rm"
SEED = 0


def corrupt(answer: str, rng: random.Random) -> str:
    """A wrong completion for `answer`, drawn from the mistakes a policy makes on addition."""
    kind = rng.random()
    digits = list(answer)
    if kind < 0.35:  # one digit changed: the policy's most common mistake
        i = rng.randrange(len(digits))
        digits[i] = rng.choice([d for d in "0123456789" if d != digits[i]])
        wrong = "".join(digits)
    elif kind < 0.6:  # off by a little, or by ten
        wrong = str(max(0, int(answer) + rng.choice([-1, 1]) * rng.choice([1, 1, 2, 3, 5, 9, 10, 10, 11, 20])))
    elif kind < 0.7 and len(digits) > 1:  # a digit dropped
        del digits[rng.randrange(len(digits))]
        wrong = "".join(digits)
    elif kind < 0.8:  # a digit added
        digits.insert(rng.randrange(len(digits) + 1), rng.choice("0123456789"))
        wrong = "".join(digits)
    elif kind < 0.85 and len(set(digits)) > 1:  # two digits swapped
        i, j = rng.sample(range(len(digits)), 2)
        digits[i], digits[j] = digits[j], digits[i]
        wrong = "".join(digits)
    elif kind < 0.93:  # the sum followed by more (an answer that did not stop)
        wrong = answer + rng.choice(["0", "1", answer, "+", "=", " 1", "c"])
    else:  # no sum at all
        wrong = rng.choice(["", " ", "c7", "=", "+", "12+", str(rng.randint(0, 198))])
    return wrong if wrong.strip() != answer else corrupt(answer, rng)


def labelled(problems, rng: random.Random) -> list[tuple[str, str, int]]:
    """(question, completion, label) for each problem: the right sum or a corrupted one, half and half."""
    return [
        (p.question, p.answer, 1) if rng.random() < 0.5 else (p.question, corrupt(p.answer, rng), 0) for p in problems
    ]


def render(tokenizer, rows) -> dict:
    """The chats the reward model actor scores (forge_rl/actors/reward_model.py), as one padded batch."""
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}, {"role": "assistant", "content": c}], tokenize=False
        )
        for q, c, _ in rows
    ]
    return tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)


def build_model(base: str):
    from transformers import Qwen3ForSequenceClassification

    torch.manual_seed(SEED)
    model = Qwen3ForSequenceClassification.from_pretrained(base, num_labels=2, pad_token_id=0, dtype=torch.float32)
    torch.nn.init.zeros_(model.score.weight)  # p(right) = 0.5 everywhere at the start
    model.config.id2label, model.config.label2id = {0: "wrong", 1: "right"}, {"wrong": 0, "right": 1}
    model.config.architectures = ["Qwen3ForSequenceClassification"]
    return model


def losses(model, tokenizer, rows) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The classification loss, the auxiliary language-model loss, and the predicted labels. The LM loss (the tied
    embeddings as the output layer) is on the right sums' tokens: the body keeps learning to add from every digit,
    which a single right/wrong label per example teaches slowly; only the classifier is saved."""
    batch = render(tokenizer, rows)
    hidden = model.model(**batch).last_hidden_state
    last = batch.attention_mask.sum(1) - 1  # padded on the right: where HF pools, the last non-pad token
    logits = model.score(hidden)[torch.arange(len(rows)), last]
    labels = torch.tensor([label for *_, label in rows])
    targets = torch.full_like(batch.input_ids, -100)
    for i, (question, completion, label) in enumerate(rows):
        if label:  # predict the sum's digits and the turn's end, after the prompt
            prompt = tokenizer.apply_chat_template(
                [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
            )
            start = len(tokenizer(prompt, add_special_tokens=False).input_ids)
            end = start + len(tokenizer(completion, add_special_tokens=False).input_ids) + 1
            targets[i, start - 1 : end - 1] = batch.input_ids[i, start:end]
    lm = hidden @ model.model.embed_tokens.weight.T
    lm_loss = torch.nn.functional.cross_entropy(lm.flatten(0, 1), targets.flatten(), ignore_index=-100)
    return torch.nn.functional.cross_entropy(logits, labels), lm_loss, logits.argmax(-1) == labels


def train(model, tokenizer, steps: int, batch_size: int, lr: float, lm_weight: float, log_every: int = 50) -> None:
    rng = random.Random(SEED)
    stream = iter_training_problems(seed=SEED)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 50) * max(0.05, 1 - s / steps))
    model.train()
    start, right = time.perf_counter(), 0
    for step in range(steps):
        rows = labelled([next(stream) for _ in range(batch_size)], rng)
        cls_loss, lm_loss, hits = losses(model, tokenizer, rows)
        right += int(hits.sum())
        opt.zero_grad()
        (cls_loss + lm_weight * lm_loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if (step + 1) % log_every == 0:
            print(
                f"step {step + 1}/{steps}  loss {cls_loss.item():.4f} (lm {lm_loss.item():.4f})  training accuracy "
                f"{right / (log_every * batch_size):.3f}  {time.perf_counter() - start:.0f}s",
                flush=True,
            )
            right = 0
    model.eval()


@torch.no_grad()
def accuracy(model, tokenizer, rows) -> tuple[float, float, float]:
    """The fraction of rows whose label is the more likely one, overall, among right sums and among wrong ones."""
    hits = {0: [], 1: []}
    for i in range(0, len(rows), 256):
        batch = rows[i : i + 256]
        predicted = model(**render(tokenizer, batch)).logits.argmax(-1)
        for p, (*_, label) in zip(predicted.tolist(), batch):
            hits[label].append(int(p) == label)
    every = hits[0] + hits[1]
    return sum(every) / len(every), sum(hits[1]) / max(len(hits[1]), 1), sum(hits[0]) / max(len(hits[0]), 1)


@torch.no_grad()
def policy_samples(base: str, problems: list[Problem], per_problem: int = 2) -> list[tuple[str, str, int]]:
    """tiny-warm's sampled answers (temperature 1, as GRPO samples) for `problems`, labelled by exact match."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base)
    policy = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    torch.manual_seed(SEED + 1)
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p.question}], tokenize=False, add_generation_prompt=True
        )
        for p in problems
        for _ in range(per_problem)
    ]
    enc = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    out = policy.generate(
        **enc, do_sample=True, temperature=1.0, top_k=0, max_new_tokens=8, pad_token_id=0, eos_token_id=2
    )
    answers = [p for p in problems for _ in range(per_problem)]
    completions = tokenizer.batch_decode(out[:, enc.input_ids.shape[1] :], skip_special_tokens=True)
    return [(p.question, c, int(c.strip() == p.answer)) for p, c in zip(answers, completions)]


def save(model, base: str, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((Path(base) / name).read_bytes())


def main() -> None:
    from transformers import AutoTokenizer

    from forge_rl.models import resolve_model_path

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lm-weight", type=float, default=1.0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)  # a fixed thread count: the same sums in the same order on every run
    torch.use_deterministic_algorithms(True)
    base = resolve_model_path("tiny-warm")
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = build_model(base)
    train(model, tokenizer, args.steps, args.batch_size, args.lr, args.lm_weight)
    held_out = held_out_problems(500)
    corrupted = accuracy(model, tokenizer, labelled(held_out, random.Random(SEED + 2)))
    samples = policy_samples(base, held_out)
    sampled = accuracy(model, tokenizer, samples)
    positives = sum(label for *_, label in samples)
    print(
        "held-out accuracy (overall, on right sums, on wrong sums): {:.3f} {:.3f} {:.3f} on right vs corrupted sums "
        "(500 questions, about half right); {:.3f} {:.3f} {:.3f} on tiny-warm's samples ({} of them, {} right)".format(
            *corrupted, *sampled, len(samples), positives
        )
    )
    save(model, base, args.out)
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
