"""DEL against the best static LS on synthetic models whose early exits agree by context segment, or uniformly.

A synthetic model (models/synthetic.py) at a real shape, once per agreement profile (--profiles): `segments`
(models/synthetic_segments.py: the exit at default_exit_layer agrees ~0.95 in some stretches of a generation and
~0.3 in others, tens of tokens each) and `uniform` (the same agreement everywhere, `model.agreement`). On the same
random-text prompts (the kind calibration uses), each profile's rows are Vanilla, LS over a grid of (E, γ) and DEL as
its authors run it (method=del), interleaved prompt by prompt on the harness. Judged by eTPL (tokens per loaded
layer: counts, not time, so the machine's load does not move it): DEL ÷ the best LS of the grid, against the targets
(segments: ≥ 1.1, uniform: ≥ 0.95). The evidence beside it, per segment kind (the half of the vocabulary the
round's last token is in): DEL's rounds — how many drafted, the exit layers TPL chose, its α estimate at the chosen
exit, tokens drafted and accepted — and the best LS's acceptance; and every row's outputs against Vanilla's.
"""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

from del_bench.bench import harness as h
from del_bench.models import synthetic_segments as segments
from del_bench.models.synthetic import random_text
from del_bench.records import RunDir, read_jsonl

TARGETS = {"segments": 1.1, "uniform": 0.95}  # DEL's eTPL ÷ the best static LS's, at least
COLUMNS = [("profile", "profile", "", 8), "row", "eTPL", ("p.eTPL", "pooled_etpl", ".4f", 7), "α",
           ("= Vanilla", "lossless", "", 9)]


def parse(argv):
    ap = h.parser("segments", __doc__, limit=4, max_new_tokens=128)
    ap.add_argument("--model", default="synthetic-smollm2")
    ap.add_argument("--profiles", default="segments,uniform")
    ap.add_argument("--grid", default="4:2,8:1,8:2,8:4,8:8,12:4", help="LS (E:γ) pairs")
    ap.add_argument("--ablations", default="del_e", help="DEL-family method configs beside DEL (paper), as evidence "
                    "(del_e: γ from TPL, no draft-exiting on τ); empty: none")
    ap.add_argument("--prompt-len", type=int, default=32, help="characters of each random-text prompt")
    ap.add_argument("--seed", type=int, default=0, help="the prompts' seed")
    return ap.parse_args(argv)


def prompt_rows(args) -> list[dict]:
    rng = random.Random(args.seed)
    return [{"id": f"random-{i}", "prompt": random_text(rng, args.prompt_len)} for i in range(args.limit)]


def bench_profile(args, profile: str, prompts: list[str]) -> dict:
    """One profile's rows run → {rows, the model's calibration record, DEL ÷ best LS, the evidence by kind}."""
    base = [f"model={args.model}", f"model.agreement_profile={profile}", *prompts,
            f"max_new_tokens={args.max_new_tokens}", "warmup=off", *args.set]  # counts only: no warm-up to wait for
    load = h.shared_load(h.compose(*base))

    def row(label, *overrides):
        return h.row(label, f"{args.root}/{profile}", args.experiment, *base, *overrides, load=load)

    grid = h.grid_of(args.grid, args.model)
    ablations = [m for m in args.ablations.split(",") if m]
    rows = h.run_rows([row("Vanilla", "method=vanilla"), *(row(f"LS(E{e}-γ{g})", *h.ls_args("ls", e, g))
                                                          for e, g in grid), row("DEL (paper)", "method=del"),
                       *(row(m.upper().replace("_", "-"), f"method={m}") for m in ablations)], args.limit)
    table = [{**t, "profile": profile} for t in h.table(rows)]
    vanilla, ls, dl = table[0], table[1:1 + len(grid)], table[1 + len(grid)]
    for t in table:
        t["lossless"] = "{}/{}".format(*h.outputs_equal(t["out_dir"], vanilla["out_dir"]))
    best = max(ls, key=lambda t: t["etpl"])
    best["row"] += " best"
    loaded, _ = load()
    model = loaded.model
    sign = segments.draw(model, int(model.synthetic["exit_layer"]), int(model.synthetic.get("mode_neurons", 1)),
                         int(rows[0].cfg.model.seed)).sign.tolist()
    return {"profile": profile, "rows": table, "synthetic": model.synthetic,
            "del_over_best_ls": h.ratio(dl["etpl"], best["etpl"]),
            "pooled_del_over_best_ls": h.ratio(dl["pooled_etpl"], best["pooled_etpl"]),
            "best_ls": best["row"], "target": TARGETS.get(profile),
            "by_kind": {"del": del_by_kind(dl["out_dir"], sign), "best_ls": rounds_by_kind(best["out_dir"], sign),
                        **{t["row"]: del_by_kind(t["out_dir"], sign) for t in table[2 + len(grid):]}}}


def kinds_of_rounds(out_dir: str, sign: list[float]) -> list[tuple[str, dict]]:
    """(kind, round) for every drafting-capable round (round > 0) of a run: the kind of the last token before it
    (the one the round's first draft reads)."""
    outputs = {(s["sample_id"], s["repeat"]): s["output_ids"] for s in read_jsonl(Path(out_dir) / "samples.jsonl")}
    emitted, out = Counter(), []
    for r in RunDir(out_dir).rounds():
        key = (r["sample_id"], r["repeat"])
        if r["round"] > 0 and key in outputs:
            last = outputs[key][emitted[key] - 1]
            out.append((segments.KINDS[sign[last] > 0], r))
        emitted[key] += r["emitted"]
    return out


def rounds_by_kind(out_dir: str, sign: list[float]) -> dict:
    """Per kind: rounds, tokens drafted and accepted, their ratio, loaded layers and tokens per loaded layer."""
    out = {}
    for kind in segments.KINDS:
        rs = [r for k, r in kinds_of_rounds(out_dir, sign) if k == kind]
        drafted, accepted = sum(r["drafted"] for r in rs), sum(r["accepted"] for r in rs)
        layers, emitted = sum(r["loaded_layers"] for r in rs), sum(r["emitted"] for r in rs)
        out[kind] = {"rounds": len(rs), "drafted": drafted, "accepted": accepted,
                     "acceptance": h.ratio(accepted, drafted), "etpl": h.ratio(emitted, layers)}
    return out


def del_by_kind(out_dir: str, sign: list[float]) -> dict:
    """rounds_by_kind, and DEL's choices per kind: the share of rounds that drafted, the exit layers chosen (the
    most frequent, with their counts) and the mean α estimate at the chosen exit."""
    out = rounds_by_kind(out_dir, sign)
    for kind in segments.KINDS:
        rs = [r for k, r in kinds_of_rounds(out_dir, sign) if k == kind]
        exits = Counter(r.get("exit_layer") for r in rs if r["drafted"])
        alphas = [r["alpha_exit"] for r in rs if r.get("alpha_exit") is not None]
        out[kind].update(drafting_share=h.ratio(sum(r["drafted"] > 0 for r in rs), len(rs)),
                         exit_layers=dict(exits.most_common(6)),
                         mean_alpha=h.ratio(sum(alphas), len(alphas)))
    return out


def main(argv: list[str]) -> int:
    args = parse(argv)
    prompts = h.prompts_task(Path(args.root) / "prompts.jsonl", prompt_rows(args))
    results = [bench_profile(args, p, prompts) for p in args.profiles.split(",")]
    h.print_table([t for r in results for t in r["rows"]], COLUMNS,
                  f"{args.model}, {args.limit} random-text prompts, {args.max_new_tokens} new tokens, greedy; eTPL: "
                  "mean over prompts, p.eTPL: pooled")
    for r in results:
        syn = r["synthetic"]
        kinds = syn.get("agreement_by_kind") or {"all": syn["agreement"]}
        print(f"{r['profile']}: DEL ÷ {r['best_ls']} = {h.fmt(r['del_over_best_ls'], '.3f')} (pooled "
              f"{h.fmt(r['pooled_del_over_best_ls'], '.3f')}; target ≥ {r['target']}); exit agreement at layer "
              f"{syn['exit_layer']} by kind {kinds}")
        for name, kinds in r["by_kind"].items():
            for kind, v in kinds.items():
                print(f"  {name} in {kind} segments: {v}")
    h.write_result(args.out, "segments", vars(args), results=results)
    return 0
