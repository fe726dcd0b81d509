"""Cutting a generated text down to its answer (scoring side; generation itself runs to EOS / max tokens)."""

from __future__ import annotations

from collections.abc import Sequence


def cut_at(text: str, stops: Sequence[str]) -> str:
    """`text` up to the earliest of `stops` (all of it when none occurs)."""
    ends = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return text[:min(ends)] if ends else text


def first_line(text: str) -> str:
    """The first non-empty line, stripped (a one-sentence answer such as a translation)."""
    return next((line.strip() for line in text.splitlines() if line.strip()), "")
