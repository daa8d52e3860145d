"""Math answer rewards for GSM8K- and MATH-style tasks, built on `math-verify` (TRL's signature).

    rewards:
      - {name: math, weight: 1.0}          # the final answer is mathematically equal to the reference
      - {name: math_format, weight: 0.1}   # the completion ends with a final answer in a form we can read

The final answer is read from the completion as the last `\\boxed{...}`, else what follows the last `####`
(GSM8K's convention), else the last number or expression math-verify finds. The reference (`answer`) may be
a bare value, a GSM8K solution ending in `#### 42`, or LaTeX (`\\frac{3}{4}`, `$\\boxed{2\\sqrt{2}}$`).
Equivalent forms match: 0.5 = 1/2 = \\frac{1}{2}, 1,000 = 1000, "12 cm" = 12, x = 3 -> 3.

math-verify's own timeouts are on: a parse or a comparison slower than `parse_timeout_s` / `verify_timeout_s`
(args of the reward; 5 s each) gives up and scores 0 rather than spending the group's `reward_timeout_s`. They
use SIGALRM, which only works in a main thread: the reward actor runs rewards in the main thread of a worker
process (forge_rl/rewards/workers.py). Called from any other thread, they are off, and only the caller's timeout
bounds a pathological answer.
"""

import logging
import re
import threading

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

_EXTRACTION = (LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig())
_BOXED = re.compile(r"\\boxed\s*\{")
PARSE_TIMEOUT_S = 5
VERIFY_TIMEOUT_S = 5
# Its "timeout is disabled" warning, off the main thread: the caller's timeout is that timeout then.
for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(lambda record: not record.getMessage().startswith("Timeout is disabled"))


def _alarm(seconds: int) -> int | None:
    """math-verify's timeout argument: `seconds` in a main thread (SIGALRM works there), None (off) elsewhere."""
    return seconds if threading.current_thread() is threading.main_thread() else None


def _after_hashes(text: str) -> str | None:
    if "####" not in text:
        return None
    return text.rsplit("####", 1)[1].strip().replace(",", "") or None


def _parse(text: str, timeout_s: int = PARSE_TIMEOUT_S) -> list:
    """math-verify's parse of a final answer: LaTeX needs delimiters, so a bare LaTeX answer gets them. Empty
    when nothing can be read within `timeout_s` (math-verify returns [] on its timeout)."""
    parsed = parse(text, extraction_config=_EXTRACTION, parsing_timeout=_alarm(timeout_s))
    if not parsed and "$" not in text:
        parsed = parse(f"${text}$", extraction_config=_EXTRACTION, parsing_timeout=_alarm(timeout_s))
    return parsed


def final_answer(completion: str, timeout_s: int = PARSE_TIMEOUT_S) -> list:
    """The completion's final answer, parsed (empty when none can be read)."""
    if not _BOXED.search(completion) and (tail := _after_hashes(completion)) is not None:
        return _parse(tail, timeout_s)
    return _parse(completion, timeout_s)


def reference_answer(answer: str, timeout_s: int = PARSE_TIMEOUT_S) -> list:
    tail = _after_hashes(answer)
    return _parse(tail if tail is not None else answer.replace(",", "") if _is_number(answer) else answer, timeout_s)


def _is_number(text: str) -> bool:
    return bool(re.fullmatch(r"\s*-?[\d,]+(\.\d+)?\s*", text))


def math_answer(
    prompts: list,
    completions: list[str],
    answer: list[str],
    parse_timeout_s: int = PARSE_TIMEOUT_S,
    verify_timeout_s: int = VERIFY_TIMEOUT_S,
    **_,
) -> list[float]:
    """1.0 when the completion's final answer equals the reference answer mathematically; else 0.0 (also when
    reading or comparing it takes longer than math-verify's timeouts)."""
    out = []
    for completion, ref in zip(completions, answer, strict=True):
        gold, pred = reference_answer(str(ref), parse_timeout_s), final_answer(completion, parse_timeout_s)
        if not gold:
            raise ValueError(f"math: cannot read the reference answer {ref!r:.80}")
        out.append(float(bool(pred) and verify(gold, pred, timeout_seconds=_alarm(verify_timeout_s))))
    return out


def math_format(prompts: list, completions: list[str], finish_reason: list[str], **_) -> list[float]:
    """1.0 when the completion gives its final answer as \\boxed{...} or after '####', and ended on its own."""
    return [
        float(f == "stop" and (bool(_BOXED.search(c)) or _after_hashes(c) is not None))
        for c, f in zip(completions, finish_reason, strict=True)
    ]
