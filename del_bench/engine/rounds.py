"""What a decode leaves behind, shared by every schedule of the engine (decode.py's draft/verify rounds and
layer_parallel.py's AdaDecode steps): one `Round` per line of rounds.jsonl, and the `Generation` of one output."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class Round:
    """One line of rounds.jsonl. Round 0 is the prefill (it emits the first token)."""

    round: int
    exit_layer: int | None
    budget: int  # the draft budget the method asked for, after capping by tokens left
    drafted: int
    accepted: int
    emitted: int
    loaded_layers: float  # drafted·E + L; SWIFT: drafted·(L − skipped/2) + L + its optimiser's pass (an int
    # unless half a layer is left over)
    head_calls: int  # LM-head rows: draft candidates (incl. a dropped one) + verify rows up to the rejection;
    # prefill: 1, + the prefill window's w target rows for shadow-token methods (DEL)
    draft_s: float = 0.0
    verify_s: float = 0.0
    policy_s: float = 0.0  # the method's own time: plan, keep_drafting, observe, and shadow tokens
    # exit-adapter rows (model.exit_adapters): each d×d map applied in front of a draft head row (D² MACs ≈ 0.09
    # of a SmolLM2 layer); not in loaded_layers (not a decoder layer), like head_calls counted on their own
    adapter_rows: int = 0
    # shadow-token rows (layer × position) scored by the restricted/full LM head in this round: DEL's controller
    # work, which policy_s times (0 while scoring is deferred; a deferred batch counts in the round that scores it)
    shadow_rows: int = 0
    # device → host reads the engine made in the round (del_bench/transfer.py): each one drains a GPU's queue and breaks
    # a CUDA graph; greedy early exit makes one per round, plus one per candidate a method stops on (DEL's confidence)
    # and one per statistics update
    host_syncs: int = 0
    trace: dict = field(default_factory=dict)  # the method's per-round fields (Plan.trace)

    def as_dict(self) -> dict:
        row = asdict(self)
        trace = row.pop("trace")  # the method's fields become columns of their own
        return {**row, **trace}


@dataclass
class Generation:
    output_ids: list[int]
    rounds: list[Round] = field(default_factory=list)
    wall_s: float = 0.0
    ttft_s: float | None = None  # seconds from the start to the first token (the prefill; None: no token asked for)
    stopped: bool = False  # ended by EOS or a stop condition (not by max_new_tokens)
    # half-precision models only (else None): per output token, the top-2 gap of the logits it was chosen from, in
    # ulps (del_bench/numerics.py) — what judges a later departure from this output as a near-tie or a real one
    top2_gap_ulps: list[float] | None = None

    def set_gap(self, index: int, gap: float) -> None:
        """The gap of output token `index` (tokens after it, dropped by a rejection, lose theirs)."""
        if self.top2_gap_ulps is not None:
            self.top2_gap_ulps[index:] = [gap]

    @property
    def loaded_layers(self) -> int:
        return sum(r.loaded_layers for r in self.rounds)

    @property
    def head_calls(self) -> int:
        return sum(r.head_calls for r in self.rounds)

    @property
    def drafted(self) -> int:
        return sum(r.drafted for r in self.rounds)

    @property
    def accepted(self) -> int:
        return sum(r.accepted for r in self.rounds)
