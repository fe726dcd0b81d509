"""Batched decoding: throughput and speedup by batch size (1, 2, 4, 8) for Vanilla, LS and DEL, Vanilla beside each,
and transformers' batched `generate` at each batch size as the peer row.

Every row is a run with records at a batch size B (run.yaml batch_size; the round driver, del_bench/engine/batch.py;
the peer: methods/peers.PeerBatch, `generate` over up to B left-padded prompts a call), after the runner's untimed
warm-up. Rows take the prompts a chunk at a time — every row decodes prompts [kC, (k+1)C) before any decodes the next
chunk, C = the largest batch size, so a batched row's slots fill and a shared machine's drift hits every row alike.
Per row, from its records: throughput (all tokens ÷ the batch's wall seconds: records.throughput), its speedup over
Vanilla at the same batch size, its scaling over the same method at batch size 1, its throughput over `generate`'s
at the same batch size (`÷gen`), the row speed (the mean over prompts of tokens ÷ a prompt's latency, waiting for the
batch included), a prompt's latency and time to its first token (means), the batch's host reads a round and a
generated token (records.host_reads: a prefill counts as a round; none counted for `generate`), eTPL per prompt and
per batch (tokens ÷ the layers the batch loaded: records.batch_etpl), α, and how many outputs equal Vanilla's at
batch size 1 (greedy: all of ours, or batching broke losslessness; `generate`'s padded batches may depart at a
near-tie); and the speedup the batch's loads predict where each step is bound by streaming its weights once for all
its rows (a GPU's regime): its batch eTPL over its Vanilla's (`pred.`), and measured ÷ that (`meas/pred`).

On this CPU: SmolLM2 on HumanEval (short prompts; `--task cnndm` for long ones) and the LayerSkip testbed on its
held-out code prompts, LS at each model's own (E, γ), DEL as run on a CPU (`--del-method del_cpu`). `--random [bench
gpu's options …]` (the last option: what follows it goes to bench gpu's parser) runs bench gpu's model instead — its
random Llama-2-7B-shaped one in bf16 on its --device by default, or its `--model` (synthetic-llama2-7b: the 7B shape
whose early exits agree as a trained model's do; a model config), its random byte prompts (`--limit` of them,
`--max-new-tokens` each) — where batch size 1 runs twice: with the graph-captured steps (compile=auto: CUDA graphs on
CUDA) and without (compile=off); batched rows decode on the batch's own graphs (compile=auto: captured per (B, width
bucket) on CUDA).
"""

from __future__ import annotations

import argparse

import torch

from del_bench.averages import ratio
from del_bench.bench import gpu
from del_bench.bench import harness as h
from del_bench.methods.peers import peer_method
from del_bench.records import run_key_of, vanilla_baseline

TASKS = {"smollm2-135m": "humaneval", "testbed": "code"}
COLUMNS = ["row", ("B", "batch_size", "d", 3), ("tok/s", "throughput", ".1f", 7), "speedup",
           ("×B=1", "scaling", "x", 6), ("÷gen", "over_generate", "x", 5),
           ("row tok/s", "tokens_per_s", ".1f", 9), ("lat. s", "latency_s", ".2f", 6),
           ("TTFT s", "ttft_s", ".3f", 6), ("reads/rd", "host_reads_per_round", ".2f", 8),
           ("reads/tok", "host_reads_per_token", ".3f", 9), "eTPL", ("b.eTPL", "batch_etpl", ".3f", 6),
           ("pred.", "predicted_speedup", ".2f", 5), ("meas/pred", "measured_over_predicted", ".2f", 9), "α",
           ("= Vanilla", "equal_vanilla", "", 9)]
SUMMARY = ("batch_size", "throughput", "batch_etpl", "latency_s", "ttft_s", "host_reads_per_round",
           "host_reads_per_token")


def parse(argv):
    ap = h.parser("batch", __doc__, limit=16, max_new_tokens=64)
    ap.add_argument("--models", default="smollm2-135m,testbed", help="comma-separated models (this CPU)")
    ap.add_argument("--task", default=None, help="every model's task (default: HumanEval, the testbed's code prompts)")
    ap.add_argument("--batch-sizes", default="1,2,4,8")
    ap.add_argument("--del-method", default="del_cpu", help="the DEL row's method config (del: the paper's)")
    ap.add_argument("--no-del", action="store_true", help="leave out the DEL rows")
    ap.add_argument("--no-generate", action="store_true", help="leave out transformers' batched generate")
    ap.add_argument("--random", nargs=argparse.REMAINDER, default=None, metavar="GPU_ARGS",
                    help="bench gpu's random model instead of --models (its shape, dtype, device, prompts options)")
    return ap.parse_args(argv)


def batch_rows(args, row, ls: tuple[int, int], graphs: bool) -> list[h.BenchRow]:
    """Vanilla, LS(E, γ), DEL and `generate` at each batch size; with `graphs`, batch size 1 also without the
    graph-captured steps (the rows at compile=auto and compile=off pair with their own Vanilla: RunKey.machine tells
    them apart)."""
    e, g = ls
    methods = [("Vanilla", ["method=vanilla"]), (f"LS(E{e}-γ{g})", h.ls_args("ls", e, g))]
    if not args.no_del:
        methods.append(("DEL", [f"method={args.del_method}"]))
    rows = []
    for B in map(int, args.batch_sizes.split(",")):
        loops = [("graphs", "compile=auto"), ("eager", "compile=off")] if graphs and B == 1 else [("", "")]
        for loop, setting in loops:
            for label, overrides in methods:
                extra = [o for o in (setting,) if o]
                rows.append(row(f"{label}{f' ({loop})' if loop else ''}", *overrides, f"batch_size={B}", *extra,
                                suffix=f"-b{B}{f'-{loop}' if loop else ''}"))
        if not args.no_generate:
            rows.append(row("HF generate †", f"batch_size={B}", "compile=off", suffix=f"-b{B}",
                            method=peer_method("hf_generate")))
    return rows


def with_batch(rows: list[h.BenchRow]) -> list[dict]:
    """h.table's rows plus each row's throughput, its speedup over the Vanilla it pairs with (same batch size),
    its scaling over the same method at batch size 1, over `generate` at the same batch size, batch eTPL, and outputs
    equal to Vanilla's at batch size 1."""
    table = h.table(rows)
    for r, t in zip(rows, table):
        t.update({key: r.summary.get(key) for key in SUMMARY}, compile=r.cfg.get("compile"))
    runs = list(zip((run_key_of(r.summary) for r in rows), table))
    first = {(t["model"], t["method_tag"], t["compile"]): t for _, t in runs if t["batch_size"] == 1}
    reference = next(t["out_dir"] for _, t in runs if t["method"] == "vanilla" and t["batch_size"] == 1)
    generate = {(t["model"], t["batch_size"]): t["throughput"] for _, t in runs if t["method"] == "hf_generate"}
    for key, t in runs:
        t["speedup"] = ratio(t["throughput"], vanilla_baseline(key, runs, "throughput"))
        t["predicted_speedup"] = ratio(t["batch_etpl"], vanilla_baseline(key, runs, "batch_etpl"))
        t["measured_over_predicted"] = ratio(t["speedup"], t["predicted_speedup"])
        alone = first.get((t["model"], t["method_tag"], t["compile"]))
        t["scaling"] = ratio(t["throughput"], alone and alone["throughput"])
        t["over_generate"] = ratio(t["throughput"], generate.get((t["model"], t["batch_size"])))
        t["equal_vanilla"] = "{}/{}".format(*h.outputs_equal(t["out_dir"], reference))
    return table


def cpu_rows(args) -> list[dict]:
    """Each of --models on its task, one loaded model for all its rows."""
    out = []
    for model in args.models.split(","):
        root = f"{args.root}/{model}"
        base = [f"model={model}", *h.task_overrides(args.task or TASKS.get(model, "humaneval"), model, root),
                f"max_new_tokens={args.max_new_tokens}", *args.set]
        load = h.shared_load(h.compose(*base))

        def row(label, *overrides, suffix="", method=None, base=base, root=root, load=load):
            return h.row(label, root, args.experiment, *base, *overrides, load=load, suffix=suffix, method=method)

        rows = batch_rows(args, row, h.grid_of(None, model, whole=False)[0], graphs=False)
        out += with_batch(h.run_rows(rows, args.limit, step=max(map(int, args.batch_sizes.split(",")))))
    return out


def random_rows(args) -> list[dict]:
    """bench gpu's model (random at its shape, synthetic, or a model config; its dtype, device and prompt length;
    LS at its first --configs point), --limit random prompts of --max-new-tokens each."""
    shape = gpu.parse_args([*args.random, "--prompts", str(args.limit), "--max-new-tokens", str(args.max_new_tokens)])
    device = torch.device(shape.device)
    base, load, info = gpu.setup_model(shape, device)
    stack = info["stack"]
    print(f"{shape.model} at {stack.num_layers} layers × {stack.embed_weight.shape[1]}, {shape.dtype} on {device}; "
          f"our loop: {stack.layer_path}")

    def row(label, *overrides, suffix="", method=None):
        return h.row(label, args.root, args.experiment, *base, *args.set, *overrides, load=load, suffix=suffix,
                     method=method)

    grid = h.grid_of(shape.configs or (f"{max(1, stack.num_layers // 4)}:6" if shape.model == "random" else None),
                     "tiny-random" if shape.model == "random" else shape.model, whole=False)
    rows = batch_rows(args, row, grid[0], graphs=True)
    return with_batch(h.run_rows(rows, args.limit, step=max(map(int, args.batch_sizes.split(",")))))


def main(argv: list[str]) -> int:
    args = parse(argv)
    table = random_rows(args) if args.random is not None else cpu_rows(args)
    for model in dict.fromkeys(t["model"] for t in table):
        h.print_table([t for t in table if t["model"] == model], COLUMNS,
                      f"{model}, {args.limit} prompts, {args.max_new_tokens} new tokens, greedy; tok/s = throughput "
                      "over the batch, speedup over Vanilla at the same B, ×B=1 over the same method at B = 1")
    h.write_result(args.out, "batch", vars(args), rows=table)
    return 0
