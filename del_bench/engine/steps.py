"""What a round's steps hand each other: a Draft (drafting → verification, acceptance, accounting) and a Verified
(verification → acceptance, observation, selection), whatever the draft shape (engine/early_exit.py,
engine/skipping.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from del_bench.engine.sampling import Siblings
from del_bench.models.kv_cache import TreeMask
from del_bench.numerics import gap_from_top2
from del_bench.transfer import to_list


@dataclass


class Draft:
    """What drafting leaves for verification, acceptance and accounting (one round)."""

    early: list[list[torch.Tensor]] | None = None  # shadow tokens only: [position][layer] → [1, 1, D]
    exit_layer: int | None = None  # E: the draft head is the exit head of this layer (its adapter, if loaded)
    exit_states: list[torch.Tensor] = field(default_factory=list)  # layer-E states, [1, 1, D] per position
    ids: list[torch.Tensor] = field(default_factory=list)  # the d draft tokens on the device, [1] each
    drafts: list[int] = field(default_factory=list)  # the d draft tokens on the host: read as drafted where the
    # host decides on them (confidence, SWIFT), else with the round's acceptance (_accept_greedy, _accept_sampling)
    draft_probs: list[torch.Tensor | None] = field(default_factory=list)  # q_i [V] when sampling, else None
    candidates: int = 0  # draft heads applied (a dropped low-confidence candidate counts too)
    confidences: list[float] = field(default_factory=list)  # each candidate's (the last may be the dropped one)
    keep_s: float = 0.0  # time inside method.keep_drafting: policy, not drafting
    logits: torch.Tensor | None = None  # [V] the draft head's logits of the newest candidate
    siblings: list[list[int]] = field(default_factory=list)  # token tree (SWIFT): other candidates beside draft i
    wasted: int = 0  # look-ahead (Method.lookahead): passes through layers 1..E of candidates past the stop

    def tree(self) -> tuple[list[int], TreeMask, Siblings] | None:
        """The token tree of the pending token (node 0), the chain (nodes 1..d) and the siblings (leaves, in
        depth order): (the siblings' tokens in node order, the tree's mask, where each sibling's row is);
        None for a plain chain."""
        if not any(self.siblings):
            return None
        d = len(self.drafts)
        parents, tokens, rows = [-1, *range(d)], [], []
        for i, level in enumerate(self.siblings):  # siblings of draft i hang off chain node i
            rows.append(list(range(1 + d + len(tokens), 1 + d + len(tokens) + len(level))))
            parents += [i] * len(level)
            tokens += level
        return tokens, TreeMask.of(parents), Siblings(self.siblings, rows)


@dataclass


class Verified:
    """The verification batch. Over a chain (_accept_greedy, _accept_sampling) the head runs over every row at once
    and the tokens stay on the device (targets); over a token tree row by row on demand (row), only up to the first
    rejection."""

    h: torch.Tensor  # [1, d+1, D] the last layer's normed states of the d + 1 positions
    late: list[torch.Tensor] | None  # shadow tokens only: layers E+1..L, each [1, d+1, D]
    head: Callable[[torch.Tensor], torch.Tensor]  # the LM head: [1, T, D] → [1, T, V]
    rows: dict[int, int] = field(default_factory=dict)  # verified row → the verifier's greedy token there
    siblings: Siblings | None = None  # a token tree's leaves beside the chain (SWIFT with `tree: true`)
    leaf: int | None = None  # set by _accept: the accepted sibling's row, if a sibling ended the path
    gaps: dict[int, float] | None = None  # half precision only: verified row → its top-2 gap in ulps
    states: list[torch.Tensor] | None = None  # Method.wants_states: the inputs, then every (sub)layer's [1, T, D]
    targets: torch.Tensor | None = None  # _accept_greedy: the verifier's greedy token of every row, [T] on the device

    def row(self, i: int) -> torch.Tensor:
        """The verifier's logits [V] at position i (the target_row of accept_greedy / accept_sampling)."""
        logits = self.head(self.h[:, i : i + 1])[0, 0]  # [V]
        if self.gaps is None:
            self.rows[i] = to_list(logits.argmax())
        else:  # one read: the argmax and the top-2 logits (its gap)
            top2 = logits.topk(2)
            values = to_list(torch.cat([top2.indices[:1].double(), top2.values.double()]))
            self.rows[i] = int(values[0])
            self.gaps[i] = gap_from_top2(values[1], values[2], logits.dtype)
        return logits


def whole(layers: float) -> float:
    """Loaded layers as an int where they are whole (every method but SWIFT's odd sublayer counts)."""
    return int(layers) if float(layers).is_integer() else layers
