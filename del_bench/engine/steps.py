"""What a round's steps hand each other, whatever the draft shape: a Draft (drafting → verification, acceptance,
accounting) and a Verified (verification → acceptance, observation, selection); the draft head's host side, which
every shape shares (a candidate, its confidence, the method's stop decision); and the registry of draft shapes.

A draft shape is one engine module (engine/early_exit.py, engine/skipping.py, …) with a `DraftShape` subclass that
drafts and verifies every row of a batch at once (B ≥ 1); a method names its shape (`Method.draft_shape`) and the
batch finds it here by that name — importing `del_bench.engine.<name>` the first time it is asked for, so a new shape
is one new file, registered by defining its class."""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from del_bench.engine.graph_runners import TokenTail
from del_bench.engine.sampling import Siblings
from del_bench.methods.base import Method
from del_bench.models.kv_cache import TreeMask
from del_bench.models.layer_math import top_confidence
from del_bench.numerics import gap_from_top2, widened
from del_bench.transfer import to_list


@dataclass
class Draft:
    """What drafting leaves for verification, acceptance and accounting (one round)."""

    early: list[list[torch.Tensor]] | None = None  # shadow tokens only: [position][layer] → [1, 1, D]
    exit_layer: int | None = None  # E: the draft head is the exit head of this layer (its adapter, if loaded)
    exit_states: list[torch.Tensor] = field(default_factory=list)  # layer-E states, [1, 1, D] per position
    ids: list[torch.Tensor] = field(default_factory=list)  # the d draft tokens on the device, [1] each
    drafts: list[int] = field(default_factory=list)  # the d draft tokens on the host: read as drafted where the
    # host decides on them (confidence, SWIFT), else with the round's acceptance (acceptance.chain)
    draft_probs: list[torch.Tensor | None] = field(default_factory=list)  # q_i [V] when sampling, else None
    candidates: int = 0  # draft heads applied (a dropped low-confidence candidate counts too)
    confidences: list[float] = field(default_factory=list)  # each candidate's (the last may be the dropped one)
    keep_s: float = 0.0  # time inside method.keep_drafting: policy, not drafting
    logits: torch.Tensor | None = None  # [V] the draft head's logits of the newest candidate
    siblings: list[list[int]] = field(default_factory=list)  # token tree (SWIFT): other candidates beside draft i
    wasted: int = 0  # look-ahead (Method.lookahead): passes through layers 1..E of candidates past the stop
    # a draft chain's (engine/draft_chain.py): what it leaves for the acceptance read to bring to the host, and the
    # host's part once read — the method's decisions, the draft trimmed to what it kept (until then `ids` and the
    # states hold the whole budget's, verified together)
    undecided: tuple[torch.Tensor, Callable[[list], None]] | None = None

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
    """The verification batch. Over a chain (acceptance.chain) the head runs over every row at once
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
    targets: torch.Tensor | None = None  # acceptance.chain: the verifier's greedy token of every row, [T] on the device
    tail: TokenTail | None = None  # the step's graph ran the head too (graph_runners.TokenTail): its logits, tokens

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


# ---- the draft head's host side, shared by the shapes --------------------------------------------------------------
def candidate_of(engine, draft: Draft, logits: torch.Tensor, rng, method: Method) -> tuple[
        torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """A row's draft candidate from its draft head's logits [V] (a batch computes every row's in one product), all on
    the device: (the candidate token [1], its confidence [] where the method stops on one, the warped draft
    distribution q [V] when sampling)."""
    draft.logits = logits
    draft.candidates += 1
    if not engine.sampling.do_sample:
        return (*greedy_candidate(logits, method.wants_confidence, method.shadow_vocab), None)
    q = engine.sampling.probs(logits)  # the warped draft distribution [V]
    token = rng.sample(q)  # [1]
    # its top probability: it does not depend on which token was sampled, so stopping on it keeps speculative
    # sampling exact (on τ's scale: see greedy_candidate)
    top = top_confidence(q, method.shadow_vocab) if method.wants_confidence else None
    return token, top, q


def greedy_candidate(logits: torch.Tensor, confident: bool, vocab: int | None) -> tuple[
        torch.Tensor, torch.Tensor | None]:
    """A greedy draft candidate from the draft head's logits [V], on the device: (its token [1], its confidence []
    where the method stops on one, else None). The confidence is the top probability on τ's scale,
    as shadow confidences are computed: in float32 for half-precision models (numerics.widened), and with
    shadow_vocab = K (vocab) normalised over the first K ids and the top token (top_confidence) — both must compare
    like with like. The engine's step (candidate_of) and the device's draft chain (engine/draft_chain.py) both
    call it: the same ops, so the same bits and stop decisions."""
    token = logits.argmax(-1, keepdim=True)  # [1]
    if not confident:
        return token, None
    return token, top_confidence(widened(logits).softmax(-1), vocab)


def judge(draft: Draft, method: Method, token: torch.Tensor, q: torch.Tensor | None, candidate: int,
          confidence: float) -> tuple[int | None, bool]:
    """Once a candidate and its confidence are on the host: the method's stop decision, and the candidate joins the
    draft unless dropped → (candidate, or None: dropped; keep drafting after it)."""
    keep = decide(draft, method, candidate, confidence)
    if keep is None:  # Algorithm 1: the candidate that stopped drafting is dropped
        return None, False
    keep_candidate(draft, token, q, candidate)
    return candidate, keep


def decide(draft: Draft, method: Method, candidate: int, confidence: float) -> bool | None:
    """The method's stop decision on a candidate read with its confidence: True (keep drafting after it), False
    (keep it, stop after), None (stop, and the candidate is dropped: drop_stopped_draft). Timed as policy."""
    draft.confidences.append(confidence)
    tp = time.perf_counter()
    keep = method.keep_drafting(len(draft.ids), confidence)
    draft.keep_s += time.perf_counter() - tp
    return None if not keep and method.drop_stopped_draft else keep


def keep_candidate(draft: Draft, token: torch.Tensor, q: torch.Tensor | None, candidate: int) -> None:
    """A candidate joins the draft (its id on the host too where it was read: candidate ≥ 0)."""
    draft.ids.append(token)
    if candidate >= 0:
        draft.drafts.append(candidate)
    draft.draft_probs.append(q)


# ---- draft shapes ------------------------------------------------------------------------------------------------
SHAPES: dict[str, "DraftShape"] = {}


class DraftShape:
    """How a round drafts and verifies, for every row of a batch at once (engine/batch.py runs the round around it:
    plan, then `draft`, `verify`, then acceptance, observation and records). Each row's round in flight is
    `slot.round` (batch_work.RowRound): `draft` leaves its Draft there, `verify` its Verified. A schedule that is not
    draft/verify rounds (`rounds = False`: AdaDecode's layer walk) does its rows' whole step in `step` instead,
    recording their Rounds itself. Subclasses register under `name` when defined (one instance each)."""

    name = ""
    rounds = True

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.name:
            SHAPES[cls.name] = cls()

    def draft(self, batch, slots: list) -> None:
        raise NotImplementedError

    def verify(self, batch, slots: list) -> None:
        raise NotImplementedError

    def step(self, batch, slots: list) -> None:
        raise NotImplementedError


def shape_named(name: str) -> DraftShape:
    """The draft shape registered as `name`, importing del_bench.engine.<name> to register it the first time."""
    if name not in SHAPES:
        try:
            importlib.import_module(f"del_bench.engine.{name}")
        except ModuleNotFoundError as err:
            raise ValueError(f"no draft shape {name!r} (registered: {', '.join(sorted(SHAPES))}; a shape is a "
                             f"DraftShape subclass in del_bench/engine/{name}.py)") from err
    if name not in SHAPES:
        raise ValueError(f"del_bench/engine/{name}.py defines no DraftShape named {name!r}")
    return SHAPES[name]
