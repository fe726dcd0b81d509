"""The two averages every reader of records takes, each with one rule for what is missing."""

from __future__ import annotations

import math
from collections.abc import Iterable


def mean(values: Iterable, empty: float | None = None) -> float | None:
    """The mean of the values that are present (None: missing, left out); `empty` where none is (None, or NaN for a
    table cell)."""
    present = [float(v) for v in values if v is not None]
    return math.fsum(present) / len(present) if present else empty


def ratio(value, base) -> float | None:
    """value ÷ base, None where either is missing or the base is 0."""
    return value / base if value is not None and base else None
