"""BLEU with sacrebleu (13a tokenisation, exp smoothing): sentence BLEU per sample, corpus BLEU per run.

Corpus BLEU is not a mean of sentence scores: it pools n-gram matches over the corpus. `score` can only
hand numbers to `aggregate`, so each sample carries its sufficient statistics (hypothesis/reference length,
n-gram matches and totals) and `corpus_bleu` sums them — equal to `BLEU().corpus_score(hyps, [refs])`.
"""

from __future__ import annotations

from sacrebleu.metrics import BLEU

ORDER = 4  # BLEU-4
STAT_KEYS = (["bleu_sys_len", "bleu_ref_len"] + [f"bleu_match_{n}" for n in range(1, ORDER + 1)]
             + [f"bleu_total_{n}" for n in range(1, ORDER + 1)])


def bleu_stats(hypothesis: str, reference: str) -> dict[str, float]:
    """Sentence BLEU (0-100, effective order as sacrebleu.sentence_bleu) plus the corpus statistics."""
    corpus = BLEU().corpus_score([hypothesis], [[reference]])
    sentence = BLEU(effective_order=True).sentence_score(hypothesis, [reference])
    values = [corpus.sys_len, corpus.ref_len, *corpus.counts, *corpus.totals]
    return {"sentence_bleu": float(sentence.score), **{k: float(v) for k, v in zip(STAT_KEYS, values)}}


def corpus_bleu(scored: list[dict]) -> float:
    """Corpus BLEU (0-100) from the per-sample statistics of `bleu_stats`."""
    sums = {k: int(sum(s[k] for s in scored)) for k in STAT_KEYS}
    score = BLEU.compute_bleu(
        correct=[sums[f"bleu_match_{n}"] for n in range(1, ORDER + 1)],
        total=[sums[f"bleu_total_{n}"] for n in range(1, ORDER + 1)],
        sys_len=sums["bleu_sys_len"], ref_len=sums["bleu_ref_len"],
        smooth_method="exp", max_ngram_order=ORDER,  # BLEU()'s corpus defaults
    )
    return float(score.score)
