"""bench controller's false-match rate: how often DEL-CPU's restricted shadow head (shadow_vocab=K: the first K ids and
each row's target) says a layer's token is the full model's where the whole vocabulary's argmax is not, and the
converse — counted on the states exact DEL scored, and recounted here from those states by masking the whole head's
logits (no shadow_tokens), so a miscount, a swapped condition or a skipped window fails."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from del_bench.bench.controller import Twin, false_match_summary, vocab_matches
from del_bench.engine.decode import Engine
from del_bench.engine.sampling import Sampling
from del_bench.models.layer_stack import LayerStack
from tests.conftest import tiny_model

K = 50  # of the tiny model's 259 ids: most argmaxes lie beyond, so false matches happen


def test_vocab_matches_counts_each_case_per_layer():
    target = torch.tensor([5, 6, 7])
    full = torch.tensor([[5, 9, 7], [1, 9, 2]])  # layer 1 matches at 0 and 2, layer 2 nowhere
    restricted = torch.tensor([[5, 6, 3], [1, 6, 7]])  # layer 1: a false match at 1, a missed one at 2; layer 2: false
    counts = vocab_matches(full, restricted, target)  # at 1 and 2
    assert counts.tolist() == [[3, 3], [2, 0], [1, 2], [1, 0]]  # positions, full matches, false, missed
    summary = false_match_summary(counts)
    assert (summary["positions"], summary["false_matches"], summary["missed_matches"]) == (6, 3, 1)
    assert summary["rate"] == pytest.approx(3 / 6) and summary["of_reported"] == pytest.approx(3 / 4)
    assert [x["of_reported"] for x in summary["layers"]] == pytest.approx([1 / 2, 1])


class Recording(Twin):
    """Twin that keeps every shadow window exact DEL scored (prefill and rounds)."""

    def start(self, num_layers):
        super().start(num_layers)
        self.seen = []

    def update(self, shadow, decay=True):
        self.seen.append(shadow)
        return super().update(shadow, decay)


def recount(stack: LayerStack, shadow) -> np.ndarray:
    """[positions, full matches, false, missed] per layer from the window's states through the whole head."""
    rows = []
    for i, states in enumerate(shadow.states):  # [W, D] layer i + 1
        logits = stack.exit_logits(states[None], i + 1)[0]  # [W, V]
        masked = torch.full_like(logits, -torch.inf)
        masked[:, :K] = logits[:, :K]
        at = shadow.target[:, None]
        masked.scatter_(1, at, logits.gather(1, at))  # the first K ids and each row's target
        full, restricted = logits.argmax(-1) == shadow.target, masked.argmax(-1) == shadow.target
        rows.append([len(full), full.sum(), (restricted & ~full).sum(), (full & ~restricted).sum()])
    return np.array(rows, dtype=np.int64).T


def test_the_twin_counts_false_matches_on_the_states_exact_del_scored():
    model, tok = tiny_model(num_layers=8)
    stack = LayerStack(model)
    twin = Recording(stack, K)
    engine = Engine(stack, Sampling(), set())
    seen = []
    for prompt in ("def add(a, b):\n", "x = [i * i for i in range(10)]\n"):
        engine.generate(tok(prompt)["input_ids"], twin, 40, seed=0)
        seen += twin.seen
    expected = sum(recount(stack, s) for s in seen)
    assert len(seen) > 10 and expected[2].sum() > 5  # the windows false matches come from, and some false matches
    assert twin.counts.tolist() == expected.tolist()
    assert expected[3].sum() == 0  # the target is always scored: a match is never missed
