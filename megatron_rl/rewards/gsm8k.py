"""GSM8K rule reward: compare the model's final number with the reference answer.

``strict`` reads the number after the last ``#### `` (GSM8K's own answer format, which the prompt asks
for); ``flexible`` takes the last number anywhere in the response. Commas and ``$`` are removed, a
trailing ``.`` is dropped, and numbers compare numerically (``42.0 == 42``).
"""

from __future__ import annotations

import re

# Regexes over very long responses are slow; the final answer sits at the end.
_CLIP_CHARS = 300
_STRICT = re.compile(r"#### *\$?(-?[0-9.,]+)")
_NUMBER = re.compile(r"-?[0-9.,]+")
METHODS = ("strict", "flexible")


def _clean(number: str) -> str:
    return number.replace(",", "").replace("$", "").rstrip(".")


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    """The model's final answer as a clean number string, or ``None`` when there is none."""
    if method not in METHODS:
        raise ValueError(f"gsm8k method={method!r} is not one of {list(METHODS)}")
    tail = solution_str[-_CLIP_CHARS:]
    found = _STRICT.findall(tail) if method == "strict" else _NUMBER.findall(tail)
    for candidate in reversed(found):
        cleaned = _clean(candidate)
        if cleaned not in ("", "-") and any(c.isdigit() for c in cleaned):
            return cleaned
    return None


def _same_number(a: str, b: str) -> bool:
    if a == b:
        return True
    try:
        return float(a) == float(b)
    except ValueError:
        return False


def compute_score(
    solution_str: str,
    ground_truth: str,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """``score`` for a correct answer, ``format_score`` for a found-but-wrong one, 0 when none is found."""
    answer = extract_solution(solution_str, method)
    if answer is None:
        return 0.0
    return float(score) if _same_number(answer, _clean(str(ground_truth))) else float(format_score)
