"""Task sources given as "package.module:function" in the task tests."""


def listed_rows(split: str = "train"):
    n = 10 if split == "train" else 3
    return [{"prompt": f"{split} {i}", "answer": i} for i in range(n)]


def streamed_rows(seed: int = 0):
    i = 0
    while True:
        yield {"prompt": f"q{seed}-{i}", "answer": str(i)}
        i += 1


def not_rows():
    return 42


def rows_then_one_without_answer(seed: int = 0):
    """Addition rows, endlessly, but row 64 (the first one the start-up checks do not read) has no answer: found
    by the dataset actor mid-run."""
    i = 0
    while True:
        yield {"prompt": f"{i % 10}+1=", "answer": str(i % 10 + 1)} if i != 64 else {"prompt": "1+1="}
        i += 1
