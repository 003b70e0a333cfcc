"""MATH rule reward: the last ``\\boxed{...}`` of the response against the reference answer.

Normalisation is deliberately light (no symbolic equivalence): spaces, ``\\left`` / ``\\right``,
``\\!``, surrounding ``$`` and a trailing ``.`` are removed, ``\\dfrac`` / ``\\tfrac`` become
``\\frac``; then strings compare, and values compare numerically when both parse as numbers
(plain decimals, ``a/b`` and ``\\frac{a}{b}``).
"""

from __future__ import annotations

import re

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_FRAC = re.compile(r"^(-?)\\frac\{(-?[0-9.]+)\}\{(-?[0-9.]+)\}$")
_SLASH = re.compile(r"^(-?[0-9.]+)/(-?[0-9.]+)$")


def _braced_from(text: str, start: int) -> str | None:
    """Contents of the brace group opening at ``text[start] == "{"``, nested braces included."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1 : i]
    return None


def last_boxed_content(text: str) -> str | None:
    """Contents of the last ``\\boxed{...}`` (or ``\\fbox{...}``, or ``\\boxed 5``); ``None`` if absent."""
    pos, command = max((text.rfind(c), c) for c in _BOX_COMMANDS)
    if pos < 0:
        return None
    after = pos + len(command)
    if text[after : after + 1] == " ":
        # "\boxed 5": the answer runs to the next "$" or the end.
        return text[after + 1 :].split("$")[0].strip()
    rest = text[after:].lstrip()
    if not rest.startswith("{"):
        return None
    return _braced_from(rest, 0)


def normalize_answer(answer: str) -> str:
    s = answer.strip().strip("$")
    for old, new in (
        ("\\left", ""),
        ("\\right", ""),
        ("\\!", ""),
        ("\\dfrac", "\\frac"),
        ("\\tfrac", "\\frac"),
    ):
        s = s.replace(old, new)
    s = "".join(s.split())
    return s.rstrip(".")


def _as_number(s: str) -> float | None:
    try:
        return float(s.replace(",", ""))
    except ValueError:
        pass
    match = _FRAC.match(s) or _SLASH.match(s)
    if match is None:
        return None
    sign, num, den = match.groups() if len(match.groups()) == 3 else ("", *match.groups())
    try:
        value = float(num) / float(den)
    except (ValueError, ZeroDivisionError):
        return None
    return -value if sign else value


def is_equiv(a: str, b: str) -> bool:
    """String equality after ``normalize_answer``, or numeric equality (relative 1e-6) when both parse."""
    na, nb = normalize_answer(a), normalize_answer(b)
    if na == nb:
        return True
    va, vb = _as_number(na), _as_number(nb)
    return va is not None and vb is not None and abs(va - vb) <= 1e-6 * max(1.0, abs(vb))


def compute_score(
    solution_str: str, ground_truth: str, score: float = 1.0, format_score: float = 0.0
) -> float:
    """``score`` when the last boxed answer matches, ``format_score`` when boxed but wrong, else 0.

    A ground truth that itself contains ``\\boxed{...}`` (a full reference solution) is reduced to it.
    """
    answer = last_boxed_content(solution_str)
    if answer is None:
        return 0.0
    truth = str(ground_truth)
    truth = last_boxed_content(truth) or truth
    return float(score) if is_equiv(answer, truth) else float(format_score)
