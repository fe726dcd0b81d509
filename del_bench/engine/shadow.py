"""DEL's shadow tokens as an object of their own (ShadowScorer): which hidden states a round's valid window holds,
their scoring by the LM head against the full model's tokens, and the deferral of that scoring while the method's
plan cannot change (Method.can_defer) — so the engine's loop only hands it a round's draft and verification.

Where the statistics come to the host (with_acceptance):
- apart (CPU): after acceptance, the window of the k + 1 valid positions is scored and read on its own — a second
  read a round, free on a CPU, where scoring the d − k rejected positions too would not be;
- with the acceptance read (an accelerator, where every read drains the queue, and a few more rows in a head pass
  bound by reading its weights cost little): before acceptance, the whole window of d + 1 positions is scored, its
  matches and confidences ride on the round's one read (ride), and only the first k + 1 columns reach the method."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from del_bench.engine.steps import Draft, Verified
from del_bench.methods.base import MAX_DEFERRED, Method, RoundEvidence, Shadow, matches_and_confidence
from del_bench.models.layer_math import cat_on
from del_bench.models.layer_stack import LayerStack
from del_bench.transfer import to_device, to_numpy


@dataclass
class Due:
    """Rounds scored whose statistics wait for a batch's read (ShadowScorer.hold_reads): `values` [2, L-1, ΣW]
    on the device; `settle` hands them over once read."""

    method: Method
    evidence: tuple
    windows: list[int]
    shadow: Shadow
    values: torch.Tensor


class ShadowScorer:
    """Per prompt: the rounds whose scoring is held back, and the shadow rows scored since the last Round."""

    def __init__(self, stack: LayerStack, with_acceptance: bool = False, hold_reads: bool = False):
        """hold_reads (a row of a batch, engine/batch.py): the statistics scored apart from acceptance are not read
        here but left `due`, for the batch to read every row's in one read and `settle`."""
        self.stack = stack
        self.with_acceptance = with_acceptance
        self.hold_reads = hold_reads
        self.due: Due | None = None
        self.deferred: list[tuple[RoundEvidence, torch.Tensor, torch.Tensor]] = []  # (evidence, states, targets)
        self.rows = 0  # shadow rows scored since the last Round was recorded (Round.shadow_rows)
        self._ridden: tuple[Shadow, torch.Tensor | np.ndarray] | None = None  # ride's scoring, then its read

    def take_rows(self) -> int:
        rows, self.rows = self.rows, 0
        return rows

    def prefill(self, layers: list[torch.Tensor], h: torch.Tensor, w: int, vocab: int | None) -> Shadow:
        """Shadow tokens of the prompt's last w positions: layers 1..L−1's kept states (each [1, w, D], on its
        layer's device) gathered on the head's device, against the full model's tokens there (w head rows)."""
        states = cat_on(layers[: self.stack.num_layers - 1], self.stack.head_device)  # [L-1, w, D]
        target = self.stack.logits(h[:, -w:])[0].argmax(-1)  # [w]
        return self.score(states, target, vocab)

    def _must_score(self, method: Method, window: int) -> bool:
        """Whether a round of this window, after the held-back ones, is scored now (else it is held back too)."""
        windows = [states.shape[1] for _, states, _ in self.deferred] + [window]
        return len(windows) >= MAX_DEFERRED or not method.can_defer(windows)

    def ride(self, method: Method, draft: Draft, verified: Verified, E: int) -> torch.Tensor | None:
        """with_acceptance, just before the acceptance read (verified.targets on the device): if the round would be
        scored now even with every draft accepted (its largest window, d + 1: a smaller one never defers less), score
        the held-back rounds and this round's whole window in one head pass → [2·(L−1)·ΣW] float64 for the read to
        carry (then received); else None (held back after acceptance, as apart)."""
        if not self.with_acceptance or draft.early is None:
            return None
        d = len(draft.ids)
        if not self._must_score(method, d + 1):
            return None
        states, targets = self.window(draft, verified, E, d)
        shadow = self.score(torch.cat([s for _, s, _ in self.deferred] + [states], dim=1),
                            torch.cat([t for _, _, t in self.deferred] + [targets]), method.shadow_vocab)
        on_device = matches_and_confidence(shadow.tokens, shadow.confidence, shadow.target)  # [2, L-1, ΣW]
        self._ridden = (shadow, on_device)
        return on_device.flatten()

    def received(self, values: list[float]) -> None:
        """ride's values as the acceptance read brought them."""
        shadow, on_device = self._ridden
        self._ridden = (shadow, np.array(values, dtype=np.float64).reshape(on_device.shape))

    def observe(self, method: Method, evidence: RoundEvidence, draft: Draft, verified: Verified, E: int) -> None:
        """Hold the round's valid window back; score every held-back round in one batch once the method may not defer
        any longer. With the window scored on the acceptance read (ride), hand those over instead."""
        if self._ridden is not None:
            (shadow, on_host), self._ridden = self._ridden, None
            evidence_list = [ev for ev, _, _ in self.deferred] + [evidence]
            spans = [t.shape[0] for _, _, t in self.deferred] + [evidence.accepted + 1]  # of d + 1 scored
            self.deferred.clear()
            self._hand_over(method, evidence_list, spans, shadow, on_host)
            return
        states, targets = self.window(draft, verified, E, evidence.accepted)
        scored_now = self._must_score(method, states.shape[1])
        self.deferred.append((evidence, states, targets))
        if scored_now:
            self.flush(method)

    def flush(self, method: Method) -> None:
        """Score the shadow tokens of every deferred round in one head pass ([L-1, ΣW, D] rows: the head's
        weights are read once, not once per round) and hand the method its evidence round by round, in order."""
        evidence, states, targets = zip(*self.deferred)
        self.deferred.clear()
        shadow = self.score(torch.cat(states, dim=1), torch.cat(targets), method.shadow_vocab)
        # the rounds' matches and confidences come to the host in one read, not one per round
        on_device = matches_and_confidence(shadow.tokens, shadow.confidence, shadow.target)  # [2, L-1, ΣW]
        windows = [t.shape[0] for t in targets]
        if self.hold_reads:
            self.due = Due(method, evidence, windows, shadow, on_device)
            return
        self._hand_over(method, evidence, windows, shadow, to_numpy(on_device))

    def settle(self, values: list[float]) -> None:
        """The statistics left `due`, as the batch's read brought them: handed to the method round by round."""
        due, self.due = self.due, None
        on_host = np.array(values, dtype=np.float64).reshape(due.values.shape)
        self._hand_over(due.method, due.evidence, due.windows, due.shadow, on_host)

    def _hand_over(self, method: Method, evidence, windows: list[int], shadow: Shadow, on_host: np.ndarray) -> None:
        """The method's evidence round by round, in order: round i's valid window is the windows[i] columns from
        where its scored ones start (a ridden round was scored at d + 1 and keeps its first k + 1)."""
        start = 0
        for ev, window in zip(evidence, windows):
            part = slice(start, start + window)
            start += window
            method.observe(replace(ev, shadow=Shadow(shadow.tokens[:, part], shadow.confidence[:, part],
                                                     shadow.target[part], shadow.states[:, part],
                                                     on_host[:, :, part])))

    def window(self, draft: Draft, verified: Verified, E: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden states [L-1, W, D] and the full model's tokens [W] of the valid window, positions 0..k
        (k = accepted drafts: later positions were computed on a context the model did not keep). Layers
        1..E come from drafting, E+1..L−1 from the verification batch."""
        L, W = self.stack.num_layers, k + 1
        m = min(E, L - 1)  # layers 1..m come from drafting
        # early[i][j]: position i after layer j + 1, [1, 1, D]; one cat → [W·m, 1, D] → view [m, W, D]
        head = self.stack.head_device  # shadow states and their scoring live there, whichever device made them
        states = cat_on([h for layers in draft.early[:W] for h in layers[:m]], head).view(W, m, -1).transpose(0, 1)
        if m < L - 1:  # late[j]: layers E+1.., each [1, d+1, D] → [L-1-E, W, D]
            states = torch.cat([states, cat_on(verified.late[: L - 1 - m], head)[:, :W]])  # [L-1, W, D]
        elif W > 1:
            states = states.contiguous()
        if verified.targets is not None:  # greedy: the full model's tokens never left the device
            return states, verified.targets[:W].to(states.device)
        for i in range(W):  # acceptance computed rows 0..k already; this only guards the invariant
            if i not in verified.rows:
                verified.row(i)
        target = to_device([verified.rows[i] for i in range(W)], states.device)
        return states, target

    def score(self, states: torch.Tensor, target: torch.Tensor, vocab: int | None) -> Shadow:
        """states: [L-1, W, D] (layers 1..L−1), target: [W] the full model's tokens → Shadow."""
        n_layers, W, D = states.shape
        self.rows += n_layers * W
        layers = None  # row → its layer: only exit adapters need it (each layer's rows through its own map)
        if self.stack.adapters is not None:
            layers = torch.arange(1, n_layers + 1, device=states.device).repeat_interleave(W)
        tokens, confidence = self.stack.shadow_tokens(states.reshape(-1, D), target.repeat(n_layers), vocab,
                                                      layers=layers)
        return Shadow(tokens.view(n_layers, W), confidence.view(n_layers, W), target, states)
