"""What a method is: policy only. The engine asks it, before each round, for the exit layer and the
draft budget; per drafted token, whether to keep drafting; after verification it hands it the round's
evidence. The engine owns everything else (KV cache, RNG, accounting, timing).

A method also says what it is, on its class, so that nothing else names it: its label in tables and `show`
(`label`, `label_hyperparameters`: LS(E4-γ4)), its family there (`family`), its place among a table's rows (`order`)
and, on an instance, the fixed shape of its rounds (`static_shape`: the compiled steps' graphs). Labels are read from
records — a run's method name and hyperparameters (RunKey) — without an instance or a model, so they are
classmethods; each class registers under its config name (`name`, and `aliases`) when it is defined, and
`del_bench.methods.method_class` finds it by that name."""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, field

import numpy as np
import torch
from hydra.utils import get_class

from del_bench import schema
from del_bench.schema import LAYERS, key
from del_bench.transfer import to_numpy

# rounds whose shadow scoring a method may defer (Method.can_defer) before the engine scores them anyway
MAX_DEFERRED = 16
UNBOUNDED = 1 << 30  # a draft budget with no cap (Method.static_shape)

# a method's family in the tables (Method.family): Table 4 measures a layer-skipping method's gain over Vanilla (no
# early-exit training) and an early-exit one's over LS; a peer is transformers' own decoding, marked † (records)
BASELINE, EARLY_EXIT, LAYER_SKIPPING, PEER, OTHER = "baseline", "early exit", "layer skipping", "peer", "other"
FAMILIES = (BASELINE, EARLY_EXIT, LAYER_SKIPPING, PEER, OTHER)

# every class that says its config name (Method.name, Method.aliases), by that name: del_bench.methods.method_class
REGISTRY: dict[str, type] = {}


@dataclass(frozen=True)
class SkipSet:
    """The sublayers a full-depth draft skips (SWIFT): 0-based layer indices whose attention / MLP is a
    passthrough. Loaded layers count a sublayer as half a layer: a draft token costs L − size/2."""

    attn: tuple[int, ...] = ()
    mlp: tuple[int, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "attn", tuple(sorted({int(i) for i in self.attn})))
        object.__setattr__(self, "mlp", tuple(sorted({int(i) for i in self.mlp})))

    @property
    def size(self) -> int:
        return len(self.attn) + len(self.mlp)

    def layers(self, num_layers: int) -> float:
        """Loaded layers of one draft token through this draft model (a sublayer = ½ layer)."""
        return num_layers - self.size / 2

    def as_dict(self) -> dict:
        return {"attn": list(self.attn), "mlp": list(self.mlp)}


@dataclass(frozen=True)
class Probe:
    """A candidate draft model to score (SWIFT's optimiser): one teacher-forced pass of the skip set over the
    generated tokens start .. start+length−1, predicting tokens start+1 .. start+length (matchness = the
    fraction of the `length` predictions whose argmax is the generated token). The engine runs and accounts it."""

    skip: SkipSet
    start: int
    length: int
    kind: str = "random"  # random | bayes | …: recorded in the round's trace


@dataclass(frozen=True)
class StaticShape:
    """What a method's rounds can be: every draft through layers 1..exit_layer (LS, FS, DV, DEL-γ), or an exit layer
    (or skip set) chosen round by round (None: DEL, SWIFT, CLaSp, KnapSpec), at most max_draft tokens a round. The
    graph-captured steps (engine/compiled.py StepShapes) are made for these shapes before the timed samples."""

    exit_layer: int | None  # 1-based E; None: it varies by round
    max_draft: int  # drafts a round at most (the verification batch is max_draft + 1 positions)


@dataclass(frozen=True)
class Plan:
    exit_layer: int | None  # 1-based E (draft through layers 1..E); None = no drafting this round
    max_draft: int  # draft budget γ of this round (the engine also caps it by the tokens left)
    trace: dict = field(default_factory=dict)  # extra per-round fields for rounds.jsonl (τ, α_E, …)
    skip: SkipSet | None = None  # with exit_layer None: draft at full depth with these sublayers skipped (SWIFT)


@dataclass(frozen=True)
class Shadow:
    """What every layer would have predicted over a window of positions, from hidden states the round
    already computed (no extra transformer passes). Row ℓ−1 is layer ℓ, for ℓ = 1..L−1."""

    tokens: torch.Tensor  # [L-1, W] greedy token of each layer
    confidence: torch.Tensor  # [L-1, W] its softmax probability
    target: torch.Tensor  # [W] the full model's greedy tokens x^L
    states: torch.Tensor | None = None  # [L-1, W, D] the hidden states they came from (for analysis)
    # [2, L-1, W] float64 on the host: whether each layer matched the target (0/1) and its confidence, where already
    # read (a batch of deferred rounds is read in one transfer, engine/shadow.py); else None
    on_host: np.ndarray | None = None

    def matches_and_confidence(self) -> np.ndarray:
        """[2, L-1, W] float64 on the host: matches (0/1) and confidences, both exact — in one read if not read yet."""
        if self.on_host is not None:
            return self.on_host
        return to_numpy(matches_and_confidence(self.tokens, self.confidence, self.target))


def matches_and_confidence(tokens: torch.Tensor, confidence: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """tokens, confidence [L-1, W], target [W] → [2, L-1, W] float64 on their device: matches (0/1), confidences."""
    return torch.stack([(tokens == target[None, :]).double(), confidence.double()])


@dataclass(frozen=True)
class RoundEvidence:
    exit_layer: int | None
    drafted: int
    accepted: int
    budget_capped: bool = False  # the plan's budget was cut to the tokens left (the prompt's last round)
    shadow: Shadow | None = None  # for methods with wants_shadow: positions 0..accepted (the valid window)


def _number(value) -> float | None:
    """A hyperparameter as a number for a label ('' / None / NaN: none; records and the paper's CSV give strings)."""
    if value in ("", None) or isinstance(value, bool) or (isinstance(value, float) and math.isnan(value)):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


@dataclass(kw_only=True)
class MethodConfig:
    """The keys of every method config (configs/method/*.yaml). A method's class declares its hyperparameters as a
    subclass of this, its `config`: each key's type, default (the constructor's) and range, checked before any weights
    load (del_bench/schema.py); `validate` then checks them against each other."""

    _target_: str = key(MISSING, "the method's class")
    name: str = key(MISSING, "its name in records (the class's `name`)")
    tag: str = key(MISSING, "names the method and its hyperparameters in out_dir")

    @staticmethod
    def schema_for(node) -> type:
        """The schema of the method class `_target_` names."""
        return get_class(node["_target_"]).config

    @staticmethod
    def relations(values: dict, facts: dict) -> list[str]:
        """The class's own check of its hyperparameters together, on the chosen model (Method.validate)."""
        if facts.get("num_layers") is None:
            return []
        params = {k: v for k, v in values.items() if not k.startswith("_")}
        try:
            get_class(values["_target_"])(**params).validate(facts["num_layers"])
        except ValueError as err:
            return [str(err)]
        return []


class Method:
    name = "method"  # the config's `name:`, which records keep (RunKey.method)
    config = MethodConfig  # its keys (a MethodConfig subclass): what a config of it may say, typed and ranged
    # ---- what the method is in tables and `show`, from its name and hyperparameters alone (classmethods below) ----
    aliases: tuple[str, ...] = ()  # other config names this class runs under (DEL's ablations: del_e, …)
    label = ""  # its name in tables ("LS"); "" = its config name
    # hyperparameters (describe() keys) shown after the label where set: (key, prefix) or (key, prefix, value left
    # out), e.g. (("exit_layer", "E"), ("gamma", "γ")) → LS(E4-γ4); DEL's ω is left out at its default 0.95
    label_hyperparameters: tuple[tuple, ...] = ()
    family = OTHER  # one of FAMILIES
    order = 1000  # its place among a table block's rows, low first: Vanilla 0, LS 10, …, DEL 70, peers 100+
    wants_confidence = False  # True: the engine asks `keep_drafting` after every draft candidate
    lookahead = 1  # wants_confidence: candidates drafted before their confidences are read (EarlyExit.draft)
    stops_at_threshold = False  # keep_drafting is `confidence >= stop_threshold()`: the device can decide it
    drop_stopped_draft = False  # True: the candidate that stopped drafting is discarded (DEL's Algorithm 1)
    wants_shadow = False  # True: evidence carries shadow tokens; observe_prefill gets the prompt's last ones
    prefill_window = 32  # prompt positions whose shadow tokens seed the statistics
    wants_costs = False  # True: set_costs(layer_s, head_s) is called once with measured costs
    latency_contexts: tuple[int, ...] = ()  # wants_costs: also time layer 0's sublayers at these contexts (sublayer_s)
    shadow_vocab: int | None = None  # score shadow tokens over the first K vocabulary ids only (cheap)
    # how its rounds draft and verify: the engine's draft shape of this name (engine/steps.py: early_exit — layers
    # 1..E and an exit head; skipping — every layer with sublayers skipped; layer_parallel — AdaDecode's layer walk)
    draft_shape = "early_exit"

    def __init__(self, **_):  # config keys such as `name` and `tag` are not hyperparameters
        pass

    def __init_subclass__(cls, **kwargs):
        """A class that says its own `name` is registered under it and its aliases (a subclass that keeps its
        parent's name — a test's spy, a bench's twin — is not: the name stays its parent's)."""
        super().__init_subclass__(**kwargs)
        if "name" in cls.__dict__:
            for name in (cls.name, *cls.__dict__.get("aliases", ())):
                REGISTRY[name] = cls

    @classmethod
    def table_label(cls, name: str, hyperparameters: dict) -> str:
        """The method as tables and `show` name a run of it (`name`: its config name; `hyperparameters`: its
        describe(), as records keep it): `label` with `label_hyperparameters`' values, LS(E4-γ4)."""
        return cls.labelled(cls.label or name, hyperparameters)

    @classmethod
    def labelled(cls, base: str, hyperparameters: dict) -> str:
        """`base` followed by the values of `label_hyperparameters` that are set (and not left out): LS(E4-γ4)."""
        parts = []
        for name, prefix, *left_out in cls.label_hyperparameters:
            value = _number(hyperparameters.get(name))
            if value is not None and (not left_out or value != left_out[0]):
                parts.append(f"{prefix}{value:g}")
        return f"{base}({'-'.join(parts)})" if parts else base

    @classmethod
    def table_order(cls, name: str, hyperparameters: dict) -> tuple:
        """Where a run of it goes among a table block's rows (compared with other methods' orders, low first)."""
        return (cls.order,)

    @classmethod
    def table_note(cls, name: str, hyperparameters: dict) -> str | None:
        """A note under every table that has a row of this run (what its label means), or None."""
        return None

    def static_shape(self) -> StaticShape:
        """The shape of its rounds (a fixed exit layer or none; its draft budget): which graph-captured steps a run
        makes (engine/compiled.py). Plain decoding: no drafts."""
        return StaticShape(None, 0)

    @classmethod
    def problems(cls, params: dict, num_layers: int) -> list[str]:
        """Every problem of these hyperparameters on a `num_layers`-layer model, as a run's config check finds them:
        each key against the class's `config`, then `validate`."""
        node = {"_target_": f"{cls.__module__}.{cls.__qualname__}", "name": cls.name, "tag": cls.name, **params}
        return schema.check(cls.config, node, "method", {"num_layers": num_layers})

    def validate(self, num_layers: int) -> None:
        """Raise ValueError for hyperparameters impossible together on a model with `num_layers` layers (each key's
        own type and range are the class's `config`, checked before it is built)."""

    def start(self, num_layers: int) -> None:
        """Called at the start of every prompt."""
        self.num_layers = num_layers

    def plan(self) -> Plan:
        raise NotImplementedError

    def keep_drafting(self, drafted: int, confidence: float) -> bool:
        """Called with each new draft candidate, `drafted` tokens already in the draft; confidence = the
        draft distribution's top probability (with shadow_vocab = K normalised over the first K ids and the top token,
        as shadow confidences are: layer_math.top_confidence). False stops drafting after (or, with
        drop_stopped_draft, without) this candidate."""
        return True

    def stop_threshold(self) -> float:
        """stops_at_threshold: the τ of this round that keep_drafting compares every candidate's confidence with
        (keep drafting iff confidence ≥ τ, whatever the draft so far) — so a draft chain on the device makes the
        decision itself (engine/draft_chain.py) and the host reads the round's candidates once."""
        raise NotImplementedError(f"{type(self).__name__} does not stop at a threshold")

    def tree_width(self, confidence: float) -> int:
        """Candidates at a draft depth whose chain token has this confidence (SWIFT's dynamic token tree): the
        chain token plus tree_width − 1 siblings, verified in the same batch. 1 = a plain chain (every method
        but SWIFT with `tree: true`)."""
        return 1

    def observe(self, evidence: RoundEvidence) -> None:
        """After verification of a round."""

    def probe(self, generated: int) -> Probe | None:
        """Before each round (`generated` tokens emitted so far in this prompt): a candidate skip set for the
        engine to score by one teacher-forced pass (Probe), or None. Methods that search a draft model only."""
        return None

    def scored(self, probe: Probe, matchness: float) -> dict:
        """The matchness of the probe the engine just ran; returns trace fields for the round's record."""
        return {}

    def wants_states(self) -> str | None:
        """Before a skipping round's verification (Plan.skip): keep the full model's states of its accepted rows for
        `select` — "layers" (the input embedding and every layer's output) or "sublayers" (the input and the state
        after every attention and MLP sublayer) — or None. Layer-skip selection (CLaSp, KnapSpec) only."""
        return None

    def select(self, states) -> dict:
        """After acceptance of a round whose states were kept (wants_states): `states` (engine/layer_states.py) holds
        them and runs candidate draft models on them for the method, accounted as the round's layers, head rows and
        policy time. Returns the round's trace fields."""
        return {}

    def can_defer(self, windows: list[int]) -> bool:
        """wants_shadow only: may the engine hold back the shadow scoring of the rounds not yet observed
        (their valid-window sizes), because no outcome of theirs could change the next plan? Deferred rounds
        are observed later, in order, all scored in one batch — so the statistics end up exactly the same."""
        return False

    def observe_prefill(self, shadow: Shadow) -> None:
        """After prefill (wants_shadow only): shadow tokens of the last prompt positions."""

    def set_costs(self, layer_s: float, head_s: float, batch_s: list | None = None,
                  sublayer_s: list | None = None) -> None:
        """Measured seconds per decoder layer (one token), per LM-head row, of T positions through every
        layer ([[T, s], …]) and, with latency_contexts, of one token through layer 0's attention and MLP at n cached
        positions ([[n, attention s, MLP s], …]) (wants_costs only)."""

    def describe(self) -> dict:
        """Hyperparameters as stored in records."""
        return {}

    def state(self) -> dict | None:
        """What the method carries from one prompt to the next (JSON-able), or None when it restarts with every
        prompt. The runner saves it with the run after each finished sample and restores it on resume, so an
        interrupted run — or an interleaved bench, which resumes its runs one prompt at a time — continues
        exactly as an uninterrupted one; it also undoes the untimed warm-up's effect on it."""
        return None

    def restore(self, state: dict) -> None:
        """Take back a `state()` (before `start`)."""


def exit_layer_key(default=MISSING, help: str = "E: the draft runs layers 1..E, then the model's head") -> int:
    """An exit layer's key (1 ≤ E < L): LS, FS, DV, DEL-γ."""
    return key(default, help, ge=1, lt=LAYERS)
