"""DEL's controller (SmolLM2 by default): what the shadow-token pass costs, and how often a cheap approximation
(shadow_vocab=K: score only the first K token ids + the target) changes DEL's decisions.

1. Agreement: DEL runs with exact shadow tokens; a twin DEL is fed the same rounds through the
   restricted head. Per round we compare the twins' plans (E, γ) and thresholds τ_E. Likewise for
   `shadow_every: R` (--every): a twin folds the same shadow tokens in only every R rounds; per round we compare
   the decisions that act — the exit layer when either drafts, and whether it drafts (the budget is d_max).
2. Cost: Vanilla, DEL as published, DEL with measured costs (exact shadow) and `del_cpu` (measured costs,
   shadow_vocab=K), rows interleaved per prompt (controller share = policy time / wall).

    python scripts/bench_controller.py [--model smollm2-135m] [--prompts 3] [--max-new-tokens 96] [--vocab 1024]
                                       [--repeats 1] [--every 2,4] [--out results/runs/bench/controller.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from omegaconf import OmegaConf

from del_bench.config import CONFIG_DIR
from del_bench.engine.decode import Engine
from del_bench.engine.sampling import Sampling
from del_bench.methods.base import Shadow
from del_bench.methods.dynamic_exit import DEL
from del_bench.methods.vanilla import Vanilla
from del_bench.models import loading
from del_bench.models.layer_stack import LayerStack
from del_bench.runner import eos_ids, provenance
from del_bench.tasks.humaneval import HumanEval


class Twin(DEL):
    """Exact DEL that also feeds a restricted-vocabulary copy and counts where their plans differ."""

    def __init__(self, stack: LayerStack, vocab: int, **kwargs):
        super().__init__(**kwargs)
        self.stack, self.twin = stack, DEL(shadow_vocab=vocab, **kwargs)
        self.vocab, self.rounds, self.same_plan, self.tau_gaps = vocab, 0, 0, []

    def start(self, num_layers):
        super().start(num_layers)
        self.twin.start(num_layers)

    def _approx(self, shadow: Shadow) -> Shadow:
        L1, W, D = shadow.states.shape
        tokens, conf = self.stack.shadow_tokens(shadow.states.reshape(-1, D), shadow.target.repeat(L1), self.vocab)
        return Shadow(tokens.view(L1, W), conf.view(L1, W), shadow.target)

    def _compare(self):
        self.rounds += 1
        self.same_plan += (self.exit_layer, self.gamma) == (self.twin.exit_layer, self.twin.gamma)
        self.tau_gaps.append(abs(self.threshold - float(self.twin.tau[self.exit_layer - 1])))

    def observe_prefill(self, shadow):
        super().observe_prefill(shadow)
        self.twin.update(self._approx(shadow))
        self._compare()

    def observe(self, evidence):
        super().observe(evidence)
        if evidence.shadow is not None:
            self.twin.update(self._approx(evidence.shadow))
            self._compare()


class Lagging(DEL):
    """Exact DEL (it drives the decode) with a twin that folds the same shadow tokens in every R rounds only
    (shadow_every = R); counts the rounds whose acting decision (E when drafting, or no draft) differs."""

    def __init__(self, every: int, **kwargs):
        super().__init__(**kwargs)
        self.every, self.twin, self.rounds, self.same = every, DEL(**kwargs), 0, 0

    def start(self, num_layers):
        super().start(num_layers)
        self.twin.start(num_layers)
        self.pending = []

    def set_costs(self, **costs):  # layer_s, head_s and (since the batch-cost model) batch_s
        super().set_costs(**costs)
        self.twin.set_costs(**costs)

    def observe_prefill(self, shadow):
        super().observe_prefill(shadow)
        self.twin.observe_prefill(shadow)

    def observe(self, evidence):
        super().observe(evidence)
        self.pending.append(evidence.shadow)
        if len(self.pending) >= self.every:
            for shadow in self.pending:
                self.twin.update(shadow)
            self.pending = []
        self.rounds += 1
        self.same += _acting(self) == _acting(self.twin)


def _acting(method: DEL) -> tuple:
    """What a plan does under draft_budget=d_max: the exit layer if it drafts, else nothing."""
    return (method.exit_layer, True) if method.gamma else (None, False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=1, help="passes over the prompts (rows interleaved per prompt)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--every", default="2,4", help="shadow_every values whose decision agreement to measure")
    ap.add_argument("--out", default="results/runs/bench/controller.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    loaded = loading.load(OmegaConf.load(CONFIG_DIR / "model" / f"{args.model}.yaml"))
    stack = LayerStack(loaded.model)
    engine = Engine(stack, Sampling(), eos_ids(loaded.model, loaded.tokenizer))
    prompts = [list(loaded.tokenizer(s.prompt)["input_ids"]) for s in HumanEval().load()[: args.prompts]]
    M = args.max_new_tokens

    agreement = {}
    for cost_model in ("layers", "measured"):
        twin = Twin(stack, args.vocab, cost_model=cost_model)
        if cost_model == "measured":
            costs = stack.measure_costs()
            twin.set_costs(**costs)
            twin.twin.set_costs(**costs)
        for p in prompts:
            engine.generate(p, twin, M, seed=0)
        agreement[cost_model] = {"rounds": twin.rounds, "same_plan": twin.same_plan / twin.rounds,
                                 "mean_tau_gap": statistics.fmean(twin.tau_gaps)}

    costs = stack.measure_costs()
    lagging = {}
    for every in (int(r) for r in args.every.split(",") if r):
        twin = Lagging(every, cost_model="measured", shadow_vocab=args.vocab)
        twin.set_costs(**costs)
        for p in prompts:
            engine.generate(p, twin, M, seed=0)
        lagging[every] = {"rounds": twin.rounds, "same_decision": twin.same / twin.rounds}

    def measured(**kwargs) -> DEL:
        method = DEL(cost_model="measured", **kwargs)
        method.set_costs(**costs)
        return method

    rows = {"vanilla": Vanilla, "del (paper: layer costs, exact shadow)": DEL,
            "del measured costs, exact shadow": measured,
            f"measured costs, shadow_vocab={args.vocab}": lambda: measured(shadow_vocab=args.vocab),
            f"del_cpu: measured costs, shadow_vocab={args.vocab}, deferred": lambda: measured(
                shadow_vocab=args.vocab, defer_shadow=True)}
    for make in rows.values():
        engine.generate(prompts[0], make(), 8, seed=0)  # warm-up
    # Interleaved: every prompt runs every row back to back, so drift of this shared machine over the
    # minutes of a benchmark hits all rows alike.
    stats = {name: {"speeds": [], "policy": 0.0, "wall": 0.0, "outputs": []} for name in rows}
    for _ in range(args.repeats):
        for p in prompts:
            for name, make in rows.items():
                g = engine.generate(p, make(), M, seed=0)
                st = stats[name]
                st["speeds"].append(len(g.output_ids) / g.wall_s)
                st["policy"] += sum(r.policy_s for r in g.rounds)
                st["wall"] += g.wall_s
                st["outputs"].append(g.output_ids)
    reference = stats["vanilla"]["outputs"]
    timing = {name: {"tokens_per_s": statistics.fmean(st["speeds"]), "controller_share": st["policy"] / st["wall"],
                     "equal_vanilla": all(o == r for o, r in zip(st["outputs"], reference))}
              for name, st in stats.items()}
    base = timing["vanilla"]["tokens_per_s"]
    print(f"{args.model}, {len(prompts)} HumanEval prompts, {M} new tokens, greedy\n")
    for cost_model, a in agreement.items():
        print(f"decisions (cost_model={cost_model}): restricted vocab {args.vocab} gives the same (E, γ) in "
              f"{a['same_plan']:.1%} of {a['rounds']} rounds; mean |Δτ_E| = {a['mean_tau_gap']:.4f}")
    for every, a in lagging.items():
        print(f"shadow_every={every} (del_cpu's settings): the same acting decision (E when drafting, or no draft) as "
              f"folding every round in {a['same_decision']:.1%} of {a['rounds']} rounds")
    print()
    for name, t in timing.items():
        print(f"{name:<48} {t['tokens_per_s']:7.2f} tok/s  {t['tokens_per_s'] / base:5.2f}x vanilla  "
              f"controller {t['controller_share']:.1%} of decode time  outputs = vanilla: {t['equal_vanilla']}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"settings": vars(args), "agreement": agreement, "shadow_every": lagging,
                               "timing": timing, "provenance": provenance()}, indent=2) + "\n")
    print(f"written: {out}")


if __name__ == "__main__":
    main()
