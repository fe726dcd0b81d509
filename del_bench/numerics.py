"""Lossless in half precision (docs/design.md §2.8): when may a greedy output differ from its reference?

In float32/float64 every method's greedy output equals transformers' `generate` token for token. In bfloat16/float16
two correct implementations may round differently (a fused kernel, another GEMM shape, a batched attention row), and
where the reference's top two logits lie within a few units of the dtype's spacing such a rounding difference can
flip the argmax. The rule: an output equals its reference, or its first departure is at a *near-tie* of the
reference's own logits — the top-2 gap there is at most NEAR_TIE_ULPS units of the dtype's spacing (ulp) at the top
logit's magnitude. Anything else is a real departure: a bug.

The gap is measured in ulps (`gap_ulps`), so one number judges a position in any dtype; the engine records it for
every emitted token of a half-precision run (SampleRecord.top2_gap_ulps), so the report can judge any later
departure from a Vanilla run's records alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# Top-2 gaps of at most this many ulps (of the logits' dtype, at the top logit's magnitude) are near-ties. bf16 has 8
# significant bits: a logit of 10 is held to ±1/32, and two correct bf16 forwards (one rounding more or less in a
# residual, another accumulation order) were seen to move a logit by 1–2 such steps on the testbed and tiny models;
# 4 leaves room for a few such steps on either of the two logits and still calls a clear preference a bug.
NEAR_TIE_ULPS = 4
HALF_DTYPES = (torch.bfloat16, torch.float16)


def is_half(dtype: torch.dtype) -> bool:
    return dtype in HALF_DTYPES


def widened(logits: torch.Tensor) -> torch.Tensor:
    """Logits to take a softmax of for a confidence: half precision widened to float32 (as DEL's shadow confidences,
    which τ comes from, and transformers' sampling do), float32 and float64 kept as they are — a float64 model's
    confidences stay float64, so they are the same bits on every CPU (a float32 softmax's exp and sum depend on the
    SIMD width the CPU picks: 1e-8 relative between AVX2 and AVX-512, which DEL's pinned τ would see)."""
    return logits.float() if is_half(logits.dtype) else logits


def ulp(value: float, dtype: torch.dtype) -> float:
    """The dtype's spacing at |value|: 2^floor(log2|value|) · eps (the smallest normal's spacing below it)."""
    info = torch.finfo(dtype)
    magnitude = max(abs(float(value)), info.tiny)
    return 2.0 ** math.floor(math.log2(magnitude)) * info.eps


def gap_ulps(logits: torch.Tensor, token: int | None = None, dtype: torch.dtype | None = None) -> float:
    """logits [V]: top logit − the runner-up's (or `token`'s), in ulps of `dtype` (default: the logits' own; give
    the model's dtype for logits upcast after the head, as `generate` returns them) at the top logit's magnitude.
    0 for an exact tie."""
    top2 = logits.topk(2)
    top = float(top2.values[0])
    other = float(top2.values[1]) if token is None else float(logits[token])
    return gap_from_top2(top, other, dtype or logits.dtype)


def gap_from_top2(top: float, other: float, dtype: torch.dtype) -> float:
    """gap_ulps from the top logit and the other one, already read on the host (the engine reads a round's top-2
    pairs in one transfer)."""
    return round((top - other) / ulp(top, dtype), 3)  # 1/1000 of an ulp: what records keep


@dataclass(frozen=True)
class Departure:
    """How an output compares with its reference: `equal`, `near_tie` (first departure at a near-tie of the
    reference's logits), `departs` (a real departure) or `unknown` (a departure whose gap the reference does not
    say: a full-precision reference, or a record without gaps). position: the first differing index (None if equal);
    gap: the reference's top-2 gap there, in ulps (None where unknown)."""

    kind: str
    position: int | None = None
    gap: float | None = None

    @property
    def lossless(self) -> bool:
        return self.kind in ("equal", "near_tie")


def first_difference(output: list[int], reference: list[int]) -> int | None:
    """The first index where the two differ (a length difference counts at the shorter length); None if equal."""
    for i, (a, b) in enumerate(zip(output, reference)):
        if a != b:
            return i
    return None if len(output) == len(reference) else min(len(output), len(reference))


def compare(output: list[int], reference: list[int], reference_gaps: list[float] | None,
            k: float = NEAR_TIE_ULPS) -> Departure:
    """output vs reference (greedy token ids). reference_gaps[i]: the reference's top-2 gap in ulps at position i
    (`gap_ulps` of its logits, or its record's `top2_gap_ulps`); None → a departure is `unknown`."""
    i = first_difference(output, reference)
    if i is None:
        return Departure("equal")
    if reference_gaps is None or i >= len(reference_gaps):
        return Departure("unknown", i)
    gap = reference_gaps[i]
    return Departure("near_tie" if gap <= k else "departs", i, gap)
