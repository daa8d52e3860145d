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
