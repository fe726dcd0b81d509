"""DEL's shadow tokens: what every layer would have drafted, scored from the states a round already computed —
over the full vocabulary, or (DEL-CPU, `shadow_vocab`=K) over the first K ids and each row's target only."""

from __future__ import annotations

import weakref

import torch

from del_bench.models.layer_math import softcapped
from del_bench.numerics import widened

# stack → (K, [D, K]): the head's first K rows transposed, made once per K (BPE ids ≈ frequency order). x @ W_t, not
# linear: for a few dozen rows against a cached K × D matrix the plain GEMM is ~100-200 µs faster (both models)
_HEAD_TOP: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def shadow_tokens(stack, states: torch.Tensor, targets: torch.Tensor | None = None,
                  vocab: int | None = None, chunk: int = 64,
                  layers: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy token and its softmax probability for every row of states [N, D] (pre-norm hidden
    states of any layers): what each layer would have drafted. Returns ([N] ids, [N] confidences).

    With `vocab`=K (and targets [N], the full model's token per row) only the first K vocabulary
    entries plus each row's target are scored: ~V/K times cheaper. It is exact whenever the true
    argmax is among them — in particular "matches the target" is never missed — and the confidence
    is normalised over the scored tokens only (an overestimate; DEL scores its draft candidates the same way,
    top_confidence, so that τ and what it is compared with share one scale).

    `layers` [N]: the 1-based layer of each row; with exit adapters loaded each row goes through its layer's
    adapter (exit_input), so shadow tokens are what the adapter-headed draft would have produced."""
    if stack.counter is not None:
        stack.counter.shadow_rows += states.shape[0]
    hn = stack.exit_rows(states, layers)  # [N, D] the head's inputs
    if vocab is not None and vocab < stack.vocab_size:
        return restricted(stack, hn, targets, vocab)
    tokens, confidence = [], []
    for rows in hn.split(chunk):
        probs = widened(stack.head_logits(rows[None])[0]).softmax(-1)  # [n, V]
        top, ids = probs.max(-1)
        tokens.append(ids)
        confidence.append(top)
    return torch.cat(tokens), torch.cat(confidence)


def restricted(stack, hn, targets, vocab: int):
    """hn: [N, D] the head's inputs (normed, adapted). Per row: the argmax over the first `vocab` ids and the
    row's target, and its probability normalised over them. Runs every round of DEL, on a few dozen rows, so
    each op counts (~5 µs apiece on this CPU): logsumexp reuses the max, and each row's target logit is one dot
    product (it joins the argmax and the norm only where the target lies outside the first `vocab` ids: BPE ids ≈
    frequency order, rare) — computed for every row rather than after asking the host whether any lies outside,
    a read that would stall a GPU's queue every round (the same bits either way)."""
    sub = hn @ _head_top(stack, vocab)  # [N, K]
    if stack.head_bias is not None:
        sub = sub + stack.head_bias[:vocab]
    if stack.math.final_softcap is not None:  # Gemma: the logits head_logits gives (per round, not per op)
        sub = softcapped(sub, stack.math.final_softcap)
    sub = widened(sub)
    sub_max, tokens = sub.max(-1)  # [N]
    # torch.logsumexp's own steps (amax, exp of the shifted logits, sum, log, + max), the max reused
    norm = (sub - sub_max[:, None]).exp_().sum(-1).log_().add_(sub_max)  # [N]
    return _add_targets(stack, hn, targets, targets >= vocab, sub_max, tokens, norm)


def _add_targets(stack, hn, targets, outside, sub_max, tokens, norm):
    """Rows whose target lies outside the scored ids: the target's logit joins the argmax and the norm."""
    target_rows = stack.head_weight[targets]  # [N, D] the targets' head rows
    target_logit = (hn * target_rows).sum(-1)  # [N]
    if stack.head_bias is not None:
        target_logit = target_logit + stack.head_bias[targets]
    if stack.math.final_softcap is not None:
        target_logit = softcapped(target_logit, stack.math.final_softcap)
    target_logit = widened(target_logit)
    take_target = outside & (target_logit > sub_max)
    tokens = torch.where(take_target, targets, tokens)
    norm = torch.where(outside, torch.logaddexp(norm, target_logit), norm)
    top = torch.where(take_target, target_logit, sub_max)
    return tokens, (top - norm).exp()


def _head_top(stack, vocab: int) -> torch.Tensor:
    made = _HEAD_TOP.get(stack)
    if made is None or made[0] != vocab:
        made = _HEAD_TOP[stack] = (vocab, stack.head_weight[:vocab].t().contiguous())
    return made[1]
