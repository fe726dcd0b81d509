"""An early-exit draft whose stop is decided on the device: a round's whole draft — every candidate's pass through
layers 1..E, its exit head, its confidence and the method's stop test `confidence ≥ τ` — as one captured graph, each
candidate's work inside a CUDA graph conditional node on flags the previous candidate set, so the candidates past
the stop are skipped on the device and the round reads the host once, with its acceptance (issue 51: a read per
candidate drained the GPU's queue before each next one — DEL read the host 3.7 times a round on the H200).

For early-exit methods whose stop is a threshold (Method.stops_at_threshold: DEL, DV) or the budget alone (no
confidence asked: LS, FS, DEL-E — their chain has no stop test, only the budget's), greedy, a batch of one, on captured
graphs (compiled.Graphs: CUDA graphs, or their bookkeeping replayed on a CPU: graph_runners.RecordedRunner). The
engine's side is EarlyExit.draft's (engine/early_exit.py). The chain of a round's
budget K is 2K + 1 conditional bodies, in order:

  pass k   (if `passing`): the token at position base + k through layers 1..E — its layer-E state (and, for
           DEL's shadow tokens, every layer's) into slot k of static buffers, its keys and values into the cache;
  head k   (if `drafting`, k < K): the exit head over that state → candidate k and its confidence (steps.
           greedy_candidate: the engine's own ops, so its bits); then the method's decision on the device —
           below = confidence < τ; `passing` = the candidate is kept (not below τ with drop_stopped_draft: DEL's
           Algorithm 1 drops it), `drafting` = not below τ and fewer than the round's budget drafted.

So a round runs the passes and heads the engine's host loop would (EarlyExit.draft: the pending token and every kept
candidate through 1..E — the last one's pass is verification's first part — and a head per candidate, a dropped one
too). The host does not know the draft's length until it reads: the verification runs at the budget's width over
every slot's state (those past the stop: stale, finite; their keys are overwritten before anything attends to them),
and the round's one read brings the candidates, confidences and counts with the acceptance's targets; the host then
takes the method's decisions over the candidates in order (steps.decide) as it would have one by one — the same
drafts — and keeps the verified rows up to them (steps.Draft.undecided, acceptance._greedy). An EOS among them ends
the draft there on the host (the device drafts on past it: those passes are counted `wasted`, as look-ahead's are).

The chain attends over one attended length for the whole round: the smallest that holds the budget's last slot
(a step of the host's loop takes the smallest that holds its own), so near a length boundary its passes may read up
to K more (masked) slots than the loop's would. On a CPU there is no conditional node: `when` (graph_runners)
is the host's test of the flag there, which is how the tests replay the CUDA bookkeeping."""

from __future__ import annotations

from collections.abc import Callable

import torch

from del_bench.engine.graph_runners import attended_views
from del_bench.engine.steps import greedy_candidate
from del_bench.methods.base import EARLY_EXIT, Method


def drafts_in_chain(method: Method) -> bool:
    """Whether a draft chain can draft this method's rounds: an early-exit draft stopped by a threshold on the
    candidate's confidence or by the budget alone (a stop the host must decide — CLaSp's, SWIFT's — cannot be)."""
    return method.family == EARLY_EXIT and (method.stops_at_threshold or not method.wants_confidence)


class DraftChain:
    """The static buffers every chain of one Graphs reads and writes (one round at a time) and the bodies captured
    for each (exit layer, attended length)."""

    def __init__(self, graphs, budget: int, vocab: int | None, collects: bool, confident: bool = True):
        """budget: K, the most candidates a round drafts (its graphs' conditional bodies); vocab: the method's
        shadow_vocab (confidences on τ's scale); collects: keep every layer's state of each pass (DEL); confident:
        each candidate's confidence is taken and tested against τ (else only the budget stops the draft)."""
        stack = graphs.stack
        self.graphs, self.budget, self.vocab, self.collects = graphs, budget, vocab, collects
        self.confident = confident
        device, D, L = stack.layers[0].device, stack.embed_weight.shape[1], stack.num_layers

        def scalar(dtype):
            return torch.zeros((), dtype=dtype, device=device)

        self.token = torch.zeros(1, 1, dtype=torch.long, device=device)  # the next pass's token
        self.base = torch.zeros(1, 1, dtype=torch.long, device=device)  # the pending token's position
        self.tau, self.limit, self.drop = scalar(torch.float64), scalar(torch.long), scalar(torch.bool)
        self.passing, self.drafting = scalar(torch.bool), scalar(torch.bool)  # the conditional nodes' flags
        self.count, self.passes = scalar(torch.long), scalar(torch.long)  # candidates drafted, passes run
        self.candidates = torch.zeros(budget, dtype=torch.long, device=device)
        self.confidences = torch.zeros(budget, dtype=torch.float64, device=device)  # exact: read as float64
        self.states = torch.zeros(budget + 1, 1, 1, D, dtype=stack.dtype, device=device)  # pass k's layer-E state
        self.early = (torch.zeros(budget + 1, L, 1, 1, D, dtype=stack.dtype, device=device) if collects
                      else None)  # pass k's every layer's state (layers 1..E of it)

    def key(self, exit_layer: int) -> tuple:
        """The runner's graph key's step part (compiled.Graphs._key adds the width, collects, length)."""
        return ("chain", exit_layer, self.budget, self.vocab, self.confident)

    def load(self, token: torch.Tensor, pos: int, tau: float, budget: int, drop: bool) -> None:
        """A round: from the pending token [1, 1] at position pos, at most `budget` candidates, stopping below τ (the
        candidate below dropped where `drop`). Device fills and one device copy: nothing waits."""
        self.token.copy_(token.view(1, 1))
        self.base.fill_(pos)
        self.tau.fill_(tau)
        self.limit.fill_(budget)
        self.drop.fill_(drop)
        self.passing.fill_(True)
        self.drafting.fill_(budget > 0)
        self.count.zero_()
        self.passes.zero_()

    def prime(self) -> None:
        """Every body of the chain runs (a capture's warm-up: each kernel compiled and loaded before capture)."""
        self.load(torch.zeros(1, 1, dtype=torch.long, device=self.token.device), 0, -torch.inf, self.budget, False)

    def body(self, when: Callable, exit_layer: int, length: int) -> Callable[[], None]:
        """The chain from exit layer E over the cache's first `length` slots, each candidate's work under `when`
        (flag, work): a conditional node's body on CUDA."""
        E, K = exit_layer, self.budget

        def chain() -> None:
            for k in range(K + 1):
                when(self.passing, lambda k=k: self._pass(k, E, length))
                if k < K:
                    when(self.drafting, lambda k=k: self._head(k, E))
        return chain

    def _pass(self, k: int, E: int, length: int) -> None:
        """The token at position base + k through layers 1..E: its states into slot k."""
        graphs = self.graphs
        stack, cache = graphs.stack, graphs.runner.cache
        layers = range(E)
        ks, vs = attended_views(cache, layers, length, dynamic=False)
        states: list[torch.Tensor] | None = [] if self.collects else None
        h = graphs.functions.chain([stack.layers[i] for i in layers], stack.embed(self.token), self.base + k, ks, vs,
                                   states)  # [1, 1, D]
        self.states[k].copy_(h)
        if states is not None:
            torch.stack(states, out=self.early[k, :E])
        self.passes.add_(1)
        self.passing.fill_(False)  # until a head keeps a candidate

    def _head(self, k: int, E: int) -> None:
        """Candidate k from slot k's state and the method's decision on it, on the device."""
        stack = self.graphs.stack
        logits = stack.head_logits(stack.exit_input(self.states[k], E))[0, 0]  # [V]
        token, confidence = greedy_candidate(logits, self.confident, self.vocab)  # [1], [] (or None)
        self.candidates[k : k + 1].copy_(token)
        self.count.fill_(k + 1)
        if confidence is None:  # only the budget stops the draft: every candidate passes
            self.passing.fill_(True)
            self.drafting.copy_(self.limit > k + 1)
        else:
            self.confidences[k].copy_(confidence)
            below = confidence.double() < self.tau
            self.passing.copy_(~(below & self.drop))
            self.drafting.copy_(~below & (self.limit > k + 1))
        self.token.copy_(token.view(1, 1))

    def values(self) -> torch.Tensor:
        """What the chain adds to the round's read: [count, passes, K candidates, K confidences] (float64: ids
        exact)."""
        return torch.cat([torch.stack([self.count, self.passes]).double(), self.candidates.double(),
                          self.confidences])

    def parse(self, read: list[float]) -> tuple[int, int, list[int], list[float]]:
        """values() as read → (candidates drafted, passes run, their ids, their confidences)."""
        K = self.budget
        count, passes = int(read[0]), int(read[1])
        return count, passes, [int(x) for x in read[2 : 2 + count]], read[2 + K : 2 + K + count]
