"""ROUGE-2 F1 exactly as the paper's code computes it (LayerSkip `benchmark.py`, which DEL builds on).

That code uses torchmetrics' ROUGEScore with `normalizer=lambda s: s.lower()` and the default tokenizer, so
text is lowercased and split on whitespace, and punctuation stays attached to its word ("mat." != "mat").
This differs from torchmetrics' own default (non-alphanumerics -> spaces) and from Google's rouge-score;
it needs no stemmer, hence no nltk. One score per (prediction, reference) pair; a run reports the mean,
which is what ROUGEScore.compute() gives over the same pairs.
"""

from __future__ import annotations

from torchmetrics.functional.text.rouge import rouge_score


def lowercase(text: str) -> str:
    # A named function rather than a lambda: it is the normaliser the paper's code passes.
    return text.lower()


def rouge2(prediction: str, reference: str) -> float:
    """ROUGE-2 F-measure in [0, 1]; 0 when either side has fewer than two tokens."""
    # F is symmetric, so the paper's swapped (reference, prediction) argument order does not matter.
    scores = rouge_score(prediction, reference, rouge_keys="rouge2", normalizer=lowercase)
    return float(scores["rouge2_fmeasure"])
