"""Engine efficiency per model and layer loop: measured ÷ predicted speedup, controller share, bandwidth floor.

Per model (SmolLM2 and the testbed by default) and per decoder-layer loop (--layers: eager and fused, before and
after), rows Vanilla, LS (the model config's E, γ: the testbed's is its best static point), DEL as published and
`del_cpu` (and --methods as more rows), interleaved prompt by prompt with a memory-bandwidth probe before each
prompt, so the drift of a shared machine hits every row and the floor alike. A row's speedup is against the Vanilla
of its own loop (they pair: RunKey's machine names the loop).

Columns from the records: tok/s, speedup, pred. (eTPL × L), meas/pred, ctrl (Round.policy_s ÷ decode time), ms/tok
(decode time per emitted token, prefill excluded: rounds ≥ 1 of rounds.jsonl); c.pred, the speedup of decoding
(prefill excluded) that this device's measured costs predict (engine/costs.measure_costs: a layer, a head row, a batch
of T positions; a del_cpu row's costs.json, else measured after the rows), every round priced as DEL's TPL prices a
plan (dynamic_exit.round_cost), and m/c (the measured decode speedup ÷ c.pred: 1.0 = the cost model holds on this
device — on a GPU, where a batch of d + 1 positions costs about one, as on a CPU, where it costs more). Columns from
the probe, a
micro-benchmark whose raw timings the result file keeps (`probe_s`, `gemv_s`, per prompt): floor (Vanilla only:
(bytes of weights one token reads ÷ the probe's GB/s) ÷ ms/tok, 1.0 = at the floor) and gemv (Vanilla only: a
token's matrix products alone ÷ ms/tok). The probe streams a large [in, out] fp32 matrix with x @ W at one row;
a Vanilla token reads every decoder layer's tensors, the final norm and the LM head.
"""

from __future__ import annotations

import statistics

import torch
from hydra.utils import get_class

from del_bench import session
from del_bench.averages import ratio
from del_bench.bench import harness as h
from del_bench.bench.syncs import SyncReport, measure, print_syncs
from del_bench.engine.costs import measure_costs
from del_bench.engine.decode import Engine
from del_bench.engine.sampling import Sampling
from del_bench.methods.dynamic_exit import batch_factors, round_cost
from del_bench.models.layer_math import linear
from del_bench.models.products import layer_matrices
from del_bench.records import RunDir

COLUMNS = ["row", "tok/s", "speedup", "pred.", "meas/pred", ("c.pred", "cost_predicted_speedup", "x", 6),
           ("m/c", "decode_over_cost_predicted", ".2f", 5), "ctrl", ("ms/tok", "decode_ms_per_token", ".2f", 7),
           ("floor", "floor_fraction", ".2f", 6), ("gemv", "gemv_fraction", ".2f", 5)]


def parse(argv):
    ap = h.parser("engine", __doc__, limit=6, max_new_tokens=128)
    ap.add_argument("--models", default="smollm2-135m,testbed")
    ap.add_argument("--task", default="humaneval")
    ap.add_argument("--probe-mb", type=int, default=512, help="size of the bandwidth probe's matrix")
    ap.add_argument("--layers", default="eager,fused", help="layer loops to compare (each row runs under each)")
    ap.add_argument("--methods", default="", help="more method configs as rows (e.g. clasp,knapspec,del_knapspec)")
    ap.add_argument("--quick", action="store_true", help="2 prompts, 48 new tokens, 256 MB probe: a smoke test")
    return ap.parse_args(argv)


def rows_for(extra: list[str]) -> list[tuple[str, list[str]]]:
    """(label, method overrides) of one model's rows; Vanilla first; LS at the model config's (E, γ)."""
    return [("Vanilla", ["method=vanilla"]), ("LS", ["method=ls"]), ("DEL (paper)", ["method=del"]),
            ("DEL del_cpu", ["method=del_cpu"]), *((name, [f"method={name}"]) for name in extra)]


@torch.inference_mode()
def probe_seconds(mb: int, reps: int = 5) -> tuple[int, list[float]]:
    """(bytes, seconds of each pass) of x @ W for one row x [1, in] and W [in, out] fp32 of about `mb` MB."""
    cols = 16384
    w = torch.randn(mb * 2**20 // (4 * cols), cols)  # [in, out], contiguous: the engine's layout
    x = torch.randn(1, w.shape[0])
    return w.numel() * 4, h.timings(lambda: x @ w, reps, warmup=1)


@torch.inference_mode()
def gemv_seconds(stack, reps: int = 5) -> list[float]:
    """Seconds of one token's matrix products alone, as the engine computes them (every layer's q|k|v, o, gate|up
    and down through layer_math.linear, then the LM head, at one position)."""
    mats = layer_matrices(stack)
    rows = {w.shape[1]: torch.randn(1, 1, w.shape[1], dtype=w.dtype, device=w.device) for w in mats}
    head_row = torch.randn(1, 1, stack.head_weight.shape[1], dtype=stack.dtype, device=stack.head_weight.device)

    def products():
        for w in mats:
            linear(rows[w.shape[1]], w, None)
        stack.head(head_row)

    return h.timings(products, reps)


def token_bytes(stack) -> int:
    """Bytes of weights one Vanilla token reads: every decoder layer's tensors, the final norm, the LM head."""
    tensors = [t for lay in stack.layers for t in vars(lay).values() if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in [*tensors, stack.norm_weight, stack.head_weight])


def cost_predicted_speedup(rounds: list[dict], num_layers: int, costs: dict) -> float | None:
    """The decode speedup (prefill excluded) `costs` predict for these round lines: Vanilla's cost a token (L layers
    and one head row) ÷ theirs, each round priced by dynamic_exit.round_cost. None when nothing was decoded."""
    decode = [r for r in rounds if r["round"] > 0]
    emitted = sum(r["emitted"] for r in decode)
    if not emitted:
        return None
    h = costs["head_s"] / costs["layer_s"]
    c = batch_factors(costs["batch_s"], max(r["drafted"] for r in decode) + 1) if costs.get("batch_s") else ()
    spent = sum(round_cost(r["drafted"], r["exit_layer"], r["loaded_layers"], r["head_calls"], num_layers, h, c)
                for r in decode)
    return (num_layers + h) / (spent / emitted)


def loop_costs(rows: list[dict], stack, measure=None) -> dict:
    """The measured costs of one layer loop's rows: a row's own costs.json where it was measured on this device (what
    its DEL planned on), else measured now on `stack`'s loop (`measure`, default engine/costs.measure_costs; untimed,
    after the rows)."""
    here = stack.cost_device()
    own = (RunDir(r["out_dir"]).costs() for r in rows)
    found = next((c for c in own if c is not None and c.get("device") == here), None)
    if found is not None:
        return found
    return measure() if measure is not None else measure_costs(Engine(stack, Sampling(), set()))


def add_cost_predictions(rows: list[dict], stack, num_layers: int) -> dict:
    """Fill c.pred and m/c for one layer loop's rows (Vanilla among them); returns the costs used."""
    costs = loop_costs(rows, stack)
    vanilla = next((r["decode_ms_per_token"] for r in rows if r["method"] == "vanilla"), None)
    for r in rows:
        r["cost_predicted_speedup"] = cost_predicted_speedup(RunDir(r["out_dir"]).rounds(), num_layers, costs)
        measured = vanilla / r["decode_ms_per_token"] if vanilla and r["decode_ms_per_token"] else None
        r["decode_speedup"] = measured
        r["decode_over_cost_predicted"] = ratio(measured, r["cost_predicted_speedup"])
    return costs


def decode_ms_per_token(out_dir: str) -> float:
    """Decode time per emitted token, prefill (round 0) excluded, pooled over the run's prompts."""
    rounds = [r for r in RunDir(out_dir).rounds() if r["round"] > 0]
    seconds = sum(r["draft_s"] + r["verify_s"] + r["policy_s"] for r in rounds)
    return 1000 * seconds / max(1, sum(r["emitted"] for r in rounds))


# ---- host syncs of a run config (the rows'), counted after the timed rows ------------------------------------------
ON_ACCEPTANCE = " (stats on acceptance)"  # a DEL row counted again with Engine(shadow_with_acceptance=True)


def config_syncs(cfg, load, prompt_ids: list[list[int]], shadow_with_acceptance: bool | None = None) -> SyncReport:
    """A run config's method and decoding on these prompts (token ids), set up as its run was (session.build: the
    task's generation settings and stop strings, the costs and product layouts its out_dir holds, its compiled steps),
    counted by bench/syncs.py's measure, untimed. load: () → (Loaded, LayerStack), as runner.run takes it (None: the
    config's model loaded here). shadow_with_acceptance: the Engine's (None: as the device decides)."""
    run_dir = RunDir(cfg.out_dir) if cfg.get("out_dir") else None
    ready = session.build(cfg, load, run_dir=run_dir, shadow_with_acceptance=shadow_with_acceptance)
    return measure(ready.engine, ready.method, prompt_ids, int(cfg.max_new_tokens), seed=int(cfg.seed))


def run_syncs(cfg, load, prompts: int = 2, shadow_with_acceptance: bool | None = None) -> SyncReport:
    """A finished run's syncs: config_syncs on the first `prompts` prompts it decoded (their ids from its records)."""
    records = RunDir(cfg.out_dir).finished()[:prompts]
    return config_syncs(cfg, load, [r["prompt_ids"] for r in records], shadow_with_acceptance)


def bench_syncs(rows, prompts: int = 2) -> list[dict]:
    """The host-sync rows, after the timed runs: for each finished bench row (a `label`, its run's `cfg`, its `load`),
    run_syncs on its first `prompts` prompts → SyncReport.as_dict() with its "row" label (print_syncs prints them;
    the result file keeps them). A method with shadow statistics (DEL) is counted a second time with them on the
    acceptance read, as an accelerator runs it, whatever this device's default."""
    out = []
    for r in rows:
        out.append({"row": r.label, **run_syncs(r.cfg, r.load, prompts).as_dict()})
        if get_class(r.cfg.method._target_).wants_shadow:
            out.append({"row": r.label + ON_ACCEPTANCE, **run_syncs(r.cfg, r.load, prompts, True).as_dict()})
    return out


def bench_model(model: str, args) -> dict:
    rows, loads, loops = [], {}, []
    for layers in args.layers.split(","):
        loads[layers] = h.shared_load(h.compose(f"model={model}", *args.set, f"layers={layers}"))
        for label, overrides in rows_for([m for m in args.methods.split(",") if m]):
            rows.append(h.row(f"{label} [{layers}]", f"{args.root}/{model}/{layers}", args.experiment,
                              f"model={model}", f"task={args.task}", f"max_new_tokens={args.max_new_tokens}",
                              *args.set, f"layers={layers}", *overrides, load=loads[layers]))
            loops.append(layers)
    probe = {"probe_s": [], "gemv_s": []}

    def measure_floor():  # before each prompt's rows: the machine as that prompt saw it
        size, seconds = probe_seconds(args.probe_mb)
        probe.update(probe_bytes=size, token_bytes=token_bytes(stack()))
        probe["probe_s"].append(seconds)
        probe["gemv_s"].append(gemv_seconds(stack()))

    def stack():
        return next(iter(loads.values()))()[1]

    done = h.run_rows(rows, args.limit, before_prompt=measure_floor)
    table = h.table(done)
    gbps = statistics.median(probe["probe_bytes"] / statistics.median(s) for s in probe["probe_s"]) / 1e9
    floor_ms = 1000 * probe["token_bytes"] / (gbps * 1e9)
    gemv_ms = statistics.median(h.median_ms(s) for s in probe["gemv_s"])
    for r in table:
        r["decode_ms_per_token"] = decode_ms_per_token(r["out_dir"])
        vanilla = r["method"] == "vanilla"
        r["floor_fraction"] = floor_ms / r["decode_ms_per_token"] if vanilla else None
        r["gemv_fraction"] = gemv_ms / r["decode_ms_per_token"] if vanilla else None
    costs = {layers: add_cost_predictions([t for t, loop in zip(table, loops) if loop == layers], loads[layers]()[1],
                                          done[0].cfg.model.num_layers)
             for layers in loads}  # untimed, after the rows
    return {"model": model, "rows": table, "gbps": gbps, "floor_ms_per_token": floor_ms, "gemv_ms_per_token": gemv_ms,
            **probe, "costs": costs, "host_syncs": bench_syncs(done)}  # counted after the timed rows, untimed


def main(argv: list[str]) -> int:
    args = parse(argv)
    if args.quick:
        args.limit, args.max_new_tokens, args.probe_mb = 2, 48, 256
        args.root += "-quick"
    results = [bench_model(model, args) for model in args.models.split(",")]
    for res in results:
        h.print_table(res["rows"], COLUMNS, f"{res['model']}, {args.task}, {args.limit} prompts/row, "
                      f"{args.max_new_tokens} new tokens: probe {res['gbps']:.1f} GB/s, one token reads "
                      f"{res['token_bytes'] / 1e6:.0f} MB → floor {res['floor_ms_per_token']:.2f} ms/token; its "
                      f"matrix products alone {res['gemv_ms_per_token']:.2f} ms")
        print_syncs(res["host_syncs"])
    h.write_result(args.out, "engine", vars(args), models=results)
    return 0
