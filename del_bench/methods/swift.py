"""SWIFT (Xia et al., ICLR 2025): on-the-fly self-speculative decoding by layer skipping — no early-exit training.

The draft model is the full depth with a set of attention and MLP sublayers skipped (the first and last layer,
embedding, final norm and head never); the engine drafts and verifies it (`Skipping.draft`, `Skipping.verify`). This
file is the policy: which set, how long to draft, and the optimiser that searches the set.

- Draft: stop after a draft whose top probability is < `confidence` (0.8; that draft is kept), at most `d_max`
  (25) drafts; the engine never drafts past max_new_tokens.
- Start set: the odd layers 1, 3, … (both sublayers), as the authors' code (its size need not be N).
- Optimiser (`optimise`, off when `skip_set` is given): once the prompt has produced more than
  `context_window` + 1 tokens (the authors' test; paper: 32), one step before every round — a candidate set,
  random or, every `bayes_interval`-th step, a Bayesian-optimisation suggestion (bayesian-optimization 1.5.x, UCB
  κ = `kappa`, GP alpha `gp_alpha`) — scored by one teacher-forced draft pass (the engine's Probe) over the
  window of `context_window` generated tokens: matchness = the fraction of its next-token argmaxes that equal
  the generated tokens. Every step registers its point with the optimiser; a candidate replaces the current set
  if strictly better; the search stops at matchness > `stop_matchness` (0.95), after `patience` (300) steps
  without improvement, or after `max_steps` (1000) steps.
- Encoding (`encoding`): 2(L−2) slots in [0, 1], attention slots (layers 1..L−2) first, then MLP. `topk` (the
  authors'): a point skips its N = int(2(L−2)·skip_ratio) largest coordinates; random candidates are uniform
  N-subsets, registered as their 0/1 points; BO suggestions are registered as suggested. `threshold` (Self-SD /
  Draft & Verify style, beyond the paper): a point skips the slots > 0.5, random candidates skip each slot with
  probability skip_ratio, so the count varies.

Where the paper and the authors' code differ (docs/design.md §4.5), the choice is a key:
- `scope: run` (the authors' code, default): the optimiser, the current set, its best matchness and the stop
  state persist for the whole run — later prompts use the frozen set, and a candidate must beat a score measured
  on an earlier prompt's context. `scope: prompt` (the paper's "per instance"): all restart with every prompt.
  With `scope: run` a run depends on prompt order, and the search state is saved with the run after every
  finished sample (Method.state → method_state.json), so a resumed run — or an interleaved bench, which decodes
  one prompt per invocation — continues the search exactly where it stood.
- `opt_window: first` (the authors' code): the first context_window + 1 generated tokens of the prompt;
  `last`: the latest ones (beyond the paper).
- Initial best matchness 0 (the authors' code): the first scored candidate replaces the start set, which is
  never scored itself. Stop tests: `patience` consecutive non-improving steps, `max_steps` steps in all (the
  authors' code stops one step later in both).
- `bo_polish: true` (the package's suggest, as the authors call it): UCB is maximised over 10,000 random points,
  then polished by L-BFGS-B from 11 seeds with finite-difference gradients over all 2(L−2) coordinates — on a
  CPU one suggestion took 1–30 s here (it varies with the GP's fit). `false` (beyond the paper): the same GP
  and UCB over 10,000 random points only (~0.1 s); since a point only matters through its N largest
  coordinates, the polish rarely changes the set.
- Dynamic token tree (`tree`, off by default as in the authors' released scripts): beside each draft, the
  draft's next candidates hang off the chain as leaves — n_d candidates in all at depth d, by the chain token's
  confidence c: `tree_widths` [1, 3, 5, 10] for c > `tree_confidences` [0.95, 0.8, 0.5] / else (the paper's;
  the authors' greedy code uses 3/5/8/10). One tree-masked verification pass; greedy takes the longest accepted
  path, sampling SpecInfer-style recursive rejection over the siblings (engine/sampling.py:
  accept_sampling_tree, siblings drawn from q without replacement). Records: `tree_siblings` and
  `tree_leaf_accepted` per round.

Fixed sets (`skip_set`): a dict {attn: [...], mlp: [...]} of 0-based layer indices (the authors' convention, as in
their skip_layers.json), the compact string "attn:1,3;mlp:2,4", a JSON file holding the dict, or a SWIFT run
directory — then the best set that run found (`skip_set_of`). The optimiser is off.

Records: a round's trace carries `skip_set` (compact string) on the first round of every prompt and whenever it
changes, and on optimiser rounds `opt_kind`, `opt_matchness`, `opt_best`, `opt_step`, `opt_stop` (the reason,
once), plus the engine's `opt_loaded_layers`, `opt_head_calls`, `opt_s`.
"""

from __future__ import annotations

import contextlib
import io
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from del_bench.methods.base import LAYER_SKIPPING, Method, MethodConfig, Plan, Probe, SkipSet, StaticShape
from del_bench.schema import key

ENCODINGS = ("topk", "threshold")
OPT_WINDOWS = ("first", "last")
SCOPES = ("run", "prompt")  # what the search state persists across: the authors' code / the paper's text


# ---- skip sets: the slot encoding, compact strings, reuse from records ------------------------------------------
def slot_count(num_layers: int) -> int:
    return 2 * (num_layers - 2)


def skip_count(num_layers: int, skip_ratio: float) -> int:
    """N = int(2·(L−2)·r): sublayers a `topk` candidate skips."""
    return int(slot_count(num_layers) * skip_ratio)


def set_of_slots(slots, num_layers: int) -> SkipSet:
    """Slot j < L−2 is layer j+1's attention, slot j ≥ L−2 is layer j−(L−2)+1's MLP."""
    half = num_layers - 2
    slots = [int(j) for j in slots]
    return SkipSet(attn=[j + 1 for j in slots if j < half], mlp=[j - half + 1 for j in slots if j >= half])


def odd_layers(num_layers: int) -> SkipSet:
    """The start set: both sublayers of layers 1, 3, … ≤ L−2 (the authors' uniform initialisation)."""
    layers = range(1, num_layers - 1, 2)
    return SkipSet(attn=layers, mlp=layers)


def compact(skip: SkipSet) -> str:
    """"attn:1,3;mlp:2" — how records and run keys carry a set."""
    return f"attn:{','.join(map(str, skip.attn))};mlp:{','.join(map(str, skip.mlp))}"


def skipping_plan(method: Method, skip: SkipSet, max_draft: int) -> Plan:
    """A skipping round's plan (SWIFT, CLaSp, KnapSpec): its trace names the set (compact) on a prompt's first round and
    whenever it changes; method.traced_skip remembers the set named last (None at the start of a prompt)."""
    trace = {}
    if skip != method.traced_skip:
        trace["skip_set"] = compact(skip)
        method.traced_skip = skip
    return Plan(exit_layer=None, max_draft=max_draft, skip=skip, trace=trace)


def parse_skip_set(value) -> SkipSet | None:
    """None, a mapping {attn, mlp}, a compact string, a JSON file, or a SWIFT run directory → SkipSet."""
    if value is None:
        return None
    if isinstance(value, SkipSet):
        return value
    if hasattr(value, "items"):  # dict or DictConfig
        unknown = set(value) - {"attn", "mlp"}
        if unknown:
            raise ValueError(f"method.skip_set has unknown keys {sorted(unknown)}: use attn and mlp")
        return SkipSet(attn=list(value.get("attn") or []), mlp=list(value.get("mlp") or []))
    if isinstance(value, str):
        if value.startswith("attn:") or value.startswith("mlp:"):
            parts = dict(part.split(":", 1) for part in value.split(";") if part)
            return SkipSet(attn=[int(x) for x in parts.get("attn", "").split(",") if x],
                           mlp=[int(x) for x in parts.get("mlp", "").split(",") if x])
        path = Path(value)
        if path.is_dir():
            return skip_set_of(path)
        if path.is_file():
            return parse_skip_set(json.loads(path.read_text()))
        raise ValueError(f"method.skip_set={value!r} is neither 'attn:…;mlp:…', a JSON file nor a run directory")
    raise ValueError(f"method.skip_set={value!r}: give {{attn: [...], mlp: [...]}} (0-based layers) or a path")


def skip_set_of(run_dir: str | Path) -> SkipSet:
    """The best set a SWIFT run found: per prompt, the last `skip_set` its rounds recorded (the set in use when
    it ended) and the best matchness behind it; the set of the highest. A run with a fixed set gives that set."""
    path = Path(run_dir) / "rounds.jsonl"
    if not path.is_file():
        raise ValueError(f"{run_dir} holds no rounds.jsonl: not a run directory")
    final: dict[tuple, tuple[float, str]] = {}
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        r = json.loads(line)
        output = (r["sample_id"], r.get("repeat", 0))
        best, skip = final.get(output, (-1.0, None))
        if r.get("opt_best") is not None:
            best = r["opt_best"]
        final[output] = (best, r.get("skip_set") or skip)
    found = [(best, skip) for best, skip in final.values() if skip]
    if not found:
        raise ValueError(f"{run_dir}: no round records a skip_set (not a SWIFT run?)")
    return parse_skip_set(max(found, key=lambda f: f[0])[1])


# ---- the method --------------------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class SwiftConfig(MethodConfig):
    skip_ratio: float = key(0.45, "N = int(2·(L−2)·r) sublayers skipped", gt=0, lt=1)
    skip_set: str | dict | None = key(None, "a fixed set ({attn: [...], mlp: [...]}, a JSON file or a SWIFT run dir): "
                                            "no search")
    optimise: bool = key(True, "search the set on the fly (ignored with skip_set)")
    context_window: int = key(32, "generated tokens per teacher-forced matchness pass", ge=1)
    bayes_interval: int = key(25, "every N-th search step a Bayesian-optimisation suggestion (0: random only)", ge=0)
    max_steps: int = key(1000, "search steps at most", ge=0)
    patience: int = key(300, "steps without improvement before the search stops", ge=1)
    stop_matchness: float = key(0.95, "stop once a set's matchness exceeds this", ge=0, le=1)
    kappa: float = key(2.5, "κ of the UCB acquisition", ge=0)
    gp_alpha: float = key(0.01, "the Gaussian process's noise", gt=0)
    bo_polish: bool = key(True, "the package's L-BFGS-polished suggestion (false: UCB over random points)")
    encoding: Literal[ENCODINGS] = key("topk", "topk: skip a point's N largest coordinates; threshold: those > 0.5")
    scope: Literal[SCOPES] = key("run", "run: the search persists across prompts (authors' code); prompt: restarts")
    opt_window: Literal[OPT_WINDOWS] = key("first", "first: the prompt's first generated tokens; last: the latest")
    confidence: float = key(0.8, "stop drafting after a draft whose top probability is below this", ge=0, le=1)
    d_max: int = key(25, "drafts per round at most", ge=1)
    tree: bool = key(False, "the dynamic token tree: siblings beside each draft, verified in one pass")
    tree_widths: list[int] = key([1, 3, 5, 10], "candidates at a depth, chain token included", ge=1)
    tree_confidences: list[float] = key([0.95, 0.8, 0.5], "chain confidences that choose the width, decreasing",
                                        ge=0, le=1)
    seed: int = key(0, "the search's random draws")


class Swift(Method):
    name = "swift"
    label, family, order = "SWIFT", LAYER_SKIPPING, 40
    draft_shape = "skipping"
    config = SwiftConfig
    wants_confidence = True  # stop after a draft below `confidence` (kept: drop_stopped_draft stays False)

    def __init__(self, skip_ratio: float = 0.45, skip_set=None, optimise: bool = True, context_window: int = 32,
                 bayes_interval: int = 25, max_steps: int = 1000, patience: int = 300, stop_matchness: float = 0.95,
                 kappa: float = 2.5, gp_alpha: float = 1e-2, encoding: str = "topk", scope: str = "run",
                 opt_window: str = "first", confidence: float = 0.8, d_max: int = 25, seed: int = 0,
                 bo_polish: bool = True, tree: bool = False, tree_widths=(1, 3, 5, 10),
                 tree_confidences=(0.95, 0.8, 0.5), **_):
        self.skip_ratio, self.skip_set_arg = skip_ratio, skip_set
        self.optimise, self.context_window, self.bayes_interval = optimise, context_window, bayes_interval
        self.max_steps, self.patience, self.stop_matchness = max_steps, patience, stop_matchness
        self.kappa, self.gp_alpha, self.encoding, self.scope = kappa, gp_alpha, encoding, scope
        self.opt_window, self.confidence, self.d_max, self.seed = opt_window, confidence, d_max, seed
        self.bo_polish = bo_polish
        self.tree, self.tree_widths, self.tree_confidences = tree, list(tree_widths), list(tree_confidences)
        self.fixed: SkipSet | None = None
        self._search_layers: int | None = None  # L the search state was built for (None: no state yet)

    # ---- configuration ----
    def validate(self, num_layers: int) -> None:
        self._validate_tree()
        if num_layers < 3:
            raise ValueError(f"SWIFT needs ≥ 3 layers (the first and last are never skipped), not {num_layers}")
        fixed = parse_skip_set(self.skip_set_arg)
        if fixed is not None:
            bad = [i for i in (*fixed.attn, *fixed.mlp) if not 1 <= i <= num_layers - 2]
            if bad:
                raise ValueError(f"method.skip_set names layers {bad}: only 0-based layers 1..{num_layers - 2} of this "
                                 f"{num_layers}-layer model may be skipped (never the first or the last)")
        elif self.encoding == "topk" and skip_count(num_layers, self.skip_ratio) < 1:
            raise ValueError(f"method.skip_ratio={self.skip_ratio} skips no sublayer of a {num_layers}-layer model")
        if fixed is None and self.optimise and self.bayes_interval:
            try:
                from bayes_opt import BayesianOptimization, UtilityFunction  # noqa: F401
            except ImportError as err:
                raise ValueError("SWIFT's optimiser needs bayesian-optimization 1.5.x (`pip install "
                                 "bayesian-optimization==1.5.1`; 2.0 removed UtilityFunction), or "
                                 "method.bayes_interval=0 for random search only") from err

    def _validate_tree(self) -> None:
        widths, confidences = self.tree_widths, self.tree_confidences
        if len(widths) != len(confidences) + 1:
            raise ValueError(f"method.tree_widths has {len(widths)} entries: it needs one more than "
                             f"method.tree_confidences ({len(confidences)}), the last for confidences below them all")
        if list(confidences) != sorted(confidences, reverse=True):
            raise ValueError(f"method.tree_confidences={confidences!r} must be decreasing")


    def static_shape(self) -> StaticShape:
        """A skip set chosen as it goes, up to d_max drafts a round."""
        return StaticShape(None, self.d_max)

    def describe(self) -> dict:
        fixed = parse_skip_set(self.skip_set_arg)
        out = {"skip_ratio": self.skip_ratio, "skip_set": compact(fixed) if fixed else None,
               "confidence": self.confidence, "d_max": self.d_max}
        if self.tree:
            out.update(tree=True, tree_widths=self.tree_widths, tree_confidences=self.tree_confidences)
        if fixed is None:
            out.update(optimise=self.optimise, context_window=self.context_window, bayes_interval=self.bayes_interval,
                       max_steps=self.max_steps, patience=self.patience, stop_matchness=self.stop_matchness,
                       kappa=self.kappa, encoding=self.encoding, scope=self.scope, opt_window=self.opt_window,
                       seed=self.seed, bo_polish=self.bo_polish)
        return out

    # ---- per prompt ----
    def start(self, num_layers: int) -> None:
        super().start(num_layers)
        if self.fixed is None and self.skip_set_arg is not None:
            self.fixed = parse_skip_set(self.skip_set_arg)
        if self.scope == "prompt" or self._search_layers != num_layers:
            self._reset_search(num_layers)
        self.traced_skip: SkipSet | None = None  # the set this prompt's records last named

    def state(self) -> dict | None:
        """scope: run with the optimiser on: the search (set, scores, stop state, RNGs, the optimiser's points)."""
        if self.scope != "run" or self._search_layers is None or self.stopped == "off":
            return None
        bo = None
        if self._bo is not None:
            name, keys, pos, has_gauss, gauss = self._bo._random_state.get_state()
            bo = {"params": self._bo.space.params.tolist(), "target": self._bo.space.target.tolist(),
                  "random_state": [name, keys.tolist(), pos, has_gauss, gauss]}
        return {"num_layers": self._search_layers, "current": compact(self.current), "best": self.best,
                "steps": self.steps, "since_best": self.since_best, "stopped": self.stopped,
                "rng": self.rng.bit_generator.state, "bo": bo}

    def restore(self, state: dict) -> None:
        self._reset_search(state["num_layers"])
        self.current = parse_skip_set(state["current"])
        self.best, self.steps, self.since_best = state["best"], state["steps"], state["since_best"]
        self.stopped = state["stopped"]
        self.rng.bit_generator.state = state["rng"]
        if state["bo"] is not None:
            self.num_layers = state["num_layers"]
            bo = self._optimizer()
            with contextlib.redirect_stdout(io.StringIO()):
                for params, target in zip(state["bo"]["params"], state["bo"]["target"]):
                    bo.register(params=bo.space.array_to_params(np.array(params)), target=target)
            name, keys, pos, has_gauss, gauss = state["bo"]["random_state"]
            bo._random_state.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))

    def _reset_search(self, num_layers: int) -> None:
        self._search_layers = num_layers
        self.current = self.fixed or odd_layers(num_layers)
        self.best = 0.0  # the authors' initial score: the first scored candidate replaces the start set
        self.steps = self.since_best = 0
        self.stopped: str | None = None if (self.fixed is None and self.optimise) else "off"
        self.rng = np.random.default_rng(self.seed)
        self._bo = self._utility = None
        self._pending: dict | None = None

    def plan(self) -> Plan:
        return skipping_plan(self, self.current, self.d_max)

    def keep_drafting(self, drafted: int, confidence: float) -> bool:
        return confidence >= self.confidence

    def tree_width(self, confidence: float) -> int:
        if not self.tree:
            return 1
        for threshold, width in zip(self.tree_confidences, self.tree_widths):
            if confidence > threshold:
                return width
        return self.tree_widths[-1]

    # ---- the optimiser ----
    def probe(self, generated: int) -> Probe | None:
        cw = self.context_window
        if self.stopped or generated <= cw + 1:
            return None
        bayes = self.bayes_interval and (self.steps + 1) % self.bayes_interval == 0  # the authors' every 25th
        point, skip = self._suggest() if bayes else self._random()
        self._pending = point
        start = 0 if self.opt_window == "first" else generated - 1 - cw
        return Probe(skip=skip, start=start, length=cw, kind="bayes" if bayes else "random")

    def scored(self, probe: Probe, matchness: float) -> dict:
        if self.bayes_interval:
            with contextlib.redirect_stdout(io.StringIO()):  # 1.5.x prints a line for every repeated point
                self._optimizer().register(params=self._pending, target=matchness)
        self.steps += 1
        if matchness > self.best:
            self.best, self.current, self.since_best = matchness, probe.skip, 0
            if matchness > self.stop_matchness:
                self.stopped = "matchness"
        else:
            self.since_best += 1
        if not self.stopped and self.since_best >= self.patience:
            self.stopped = "patience"
        if not self.stopped and self.steps >= self.max_steps:
            self.stopped = "max_steps"
        trace = {"opt_best": self.best, "opt_step": self.steps}
        if self.stopped:
            trace["opt_stop"] = self.stopped
        return trace

    def _names(self) -> list[str]:
        return [f"x{j:03d}" for j in range(slot_count(self.num_layers))]

    def _as_set(self, values: np.ndarray) -> SkipSet:
        if self.encoding == "topk":  # the N largest coordinates (ties: the lower slot)
            order = np.argsort(-values, kind="stable")
            return set_of_slots(order[: skip_count(self.num_layers, self.skip_ratio)], self.num_layers)
        return set_of_slots(np.flatnonzero(values > 0.5), self.num_layers)

    def _random(self) -> tuple[dict, SkipSet]:
        S = slot_count(self.num_layers)
        if self.encoding == "topk":  # a uniform N-subset of the slots
            values = np.zeros(S)
            values[self.rng.choice(S, skip_count(self.num_layers, self.skip_ratio), replace=False)] = 1.0
        else:
            values = (self.rng.random(S) < self.skip_ratio).astype(float)
        skip = self._as_set(values)
        return dict(zip(self._names(), values.tolist())), skip

    def _suggest(self) -> tuple[dict, SkipSet]:
        bo = self._optimizer()
        if self.bo_polish or len(bo.space) == 0:
            point = bo.suggest(self._utility)  # the package's: UCB's max over 10,000 random points, L-BFGS-polished
        else:  # the package's GP and UCB, maximised over 10,000 random points only (no L-BFGS polish)
            gp = self._gaussian_process()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                gp.fit(bo.space.params, bo.space.target)
            tries = self.rng.random((10_000, slot_count(self.num_layers)))
            ucb = self._utility.utility(tries, gp=gp, y_max=bo.space.target.max())
            point = bo.space.array_to_params(tries[int(np.argmax(ucb))])
        return point, self._as_set(np.array([point[name] for name in self._names()]))

    def _gaussian_process(self):
        """The Gaussian process bayesian-optimization 1.5 fits (its BayesianOptimization's: a Matérn-5/2 kernel,
        normalised targets, 5 optimiser restarts) with our alpha, seeded by the method's seed at every fit."""
        from sklearn.gaussian_process import GaussianProcessRegressor
        from sklearn.gaussian_process.kernels import Matern

        return GaussianProcessRegressor(kernel=Matern(nu=2.5), alpha=self.gp_alpha, normalize_y=True,
                                        n_restarts_optimizer=5, random_state=self.seed)

    def _optimizer(self):
        if self._bo is None:
            from bayes_opt import BayesianOptimization, UtilityFunction  # 1.5.x: UtilityFunction left in 2.0

            bounds = {name: (0.0, 1.0) for name in self._names()}
            self._bo = BayesianOptimization(f=None, pbounds=bounds, random_state=self.seed, verbose=0,
                                            allow_duplicate_points=True)
            self._bo.set_gp_params(alpha=self.gp_alpha)
            self._utility = UtilityFunction(kind="ucb", kappa=self.kappa, xi=0.0)
        return self._bo
