"""Host reads a round on the captured path, counted on a CPU by the CUDA graphs' bookkeeping replayed (issue 51).

On a GPU every host read drains the queue, so issue 51 asks of the CUDA-graph path: Vanilla 1 read a round, LS 1, DEL
(default, no look-ahead) ≤ 1.5, a batch 1. Here each method decodes on graphs made as on CUDA (`compile=graphs`: the
steps' eager kernels) by graph_runners.RecordedRunner — every capture recorded and run again on replay, a draft
chain's conditional nodes tested by the host: the same steps, static buffers, draft chains and reads CUDA graphs
would make, eagerly — with DEL's statistics riding on the acceptance read, as off a CPU. Per row: host reads a decode
round (the prefill's apart) and a generated token, rounds, the draft chains made, and whether every output equals the
same engine's on the stack's loop (no graphs). "DEL, host's loop" is DEL on the same graphs with its draft chains set
aside (a read per candidate: the engine before them). Batch rows (--batch B > 1): the batch's graphs, its reads a
round. No clock: eager replays on a CPU say nothing of a GPU's speed (`make gpu-check` measures that).

Beside the reads, what the host launches: replays a round (each a graph launch on CUDA) and host ops a round — the
tensor ops the engine dispatches outside every replay (views aside: each a kernel launch on a GPU, where the host's
time between replays is the device's idle time). "Vanilla, head after the graph" decodes on graphs made without the
token's tail (graph_runners.TokenTail: the final norm, the head, argmax and top-2 inside the step's graph), as the
engine did before it.
"""

from __future__ import annotations

import copy
import json

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from del_bench.bench import harness as h
from del_bench.bench.half_lossless import load_pair
from del_bench.engine import path_choice
from del_bench.engine.batch import Batch
from del_bench.engine.decode import Engine, Request
from del_bench.engine.graph_runners import RecordedRunner
from del_bench.engine.layer_path import LayerPath
from del_bench.engine.path_choice import stack_of
from del_bench.engine.sampling import Sampling
from del_bench.methods.dv import DraftVerify
from del_bench.methods.dynamic_exit import DEL
from del_bench.methods.ls import LayerSkip
from del_bench.methods.vanilla import Vanilla


def methods(exit_layer: int) -> list[tuple[str, object]]:
    """(label, method): Vanilla, LS and DV at the model's default exit layer, DEL as its authors run it (the default
    config's reading)."""
    return [("Vanilla", Vanilla()), (f"LS(E{exit_layer}-γ4)", LayerSkip(exit_layer, 4)),
            (f"DV(E{exit_layer})", DraftVerify(exit_layer)), ("DEL", DEL(keep_stopped_draft=True, prefill_draft=True))]


class HeadAfterGraph(RecordedRunner):
    """The stand-in without the token's tail: the head runs after the step's graph, on the host's launches."""

    tails = False


class HostOps(TorchDispatchMode):
    """Counts the tensor ops dispatched outside a recording's replay, views aside: the host's kernel launches."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not RecordedRunner.replaying and not func.is_view:
            self.ops += 1
        return func(*args, **(kwargs or {}))


def graphs_of(stack, method, tokens: int, reach: int, batch: int = 1, runner: type = RecordedRunner):
    graphs, info = path_choice.make_graphs(stack, "graphs", method, tokens, reach, capture=True,
                                           runner=runner, batch=batch)
    if graphs is None:
        raise RuntimeError(f"no graphs: {info}")
    return graphs, info


def decode(stack, prompts, eos, method, tokens: int, graphs=None) -> list:
    engine = Engine(stack, Sampling(), eos, path=LayerPath(stack, graphs), shadow_with_acceptance=True)
    return [engine.generate(p, copy.deepcopy(method), tokens, seed=0) for p in prompts]


def launches(run, tokens: int) -> tuple:
    """run(n) decodes the prompts n tokens each on the graphs; counted, the host's launches of its decode rounds →
    (what run(tokens) returned, its replays and host ops less those of run(1): the prefills and set-up, no round)."""
    counts = []
    for n in (1, tokens):
        before = RecordedRunner.replays
        with HostOps() as ops:
            out = run(n)
        counts.append((RecordedRunner.replays - before, ops.ops))
    (replays_1, ops_1), (replays, ops) = counts
    return out, {"replays": replays - replays_1, "host_ops": ops - ops_1}


def launches_alone(stack, prompts, eos, method, tokens: int, graphs) -> tuple[list, dict]:
    """launches of the prompts decoded one at a time (decode) → (the generations, the counts)."""
    return launches(lambda n: decode(stack, prompts, eos, method, n, graphs), tokens)


def row(label: str, gens: list, counts: dict, loop: list, info: dict) -> dict:
    rounds = [r for g in gens for r in g.rounds if r.round > 0]
    prefills = [r for g in gens for r in g.rounds if r.round == 0]
    tokens = sum(len(g.output_ids) for g in gens)
    reads = sum(r.host_syncs for g in gens for r in g.rounds)
    per_round = {f"{k}_per_round": v / len(rounds) for k, v in counts.items()}
    return {"row": label, "batch_size": 1, "rounds": len(rounds),
            "reads_per_round": sum(r.host_syncs for r in rounds) / len(rounds),
            "prefill_reads": sum(r.host_syncs for r in prefills) / len(prefills),
            "reads_per_token": reads / tokens, "drafting_rounds": sum(r.budget > 0 for r in rounds) / len(rounds),
            **per_round,
            "equal_loop": sum(g.output_ids == ref.output_ids for g, ref in zip(gens, loop)), "outputs": len(gens),
            "graphs": info.get("graphs"), "draft_chains": info.get("draft_chains"),
            "draft_chain_error": info.get("draft_chain_error")}


def batch_decode(stack, prompts, eos, method, tokens: int, size: int, graphs, reach: int) -> tuple[list, dict]:
    """The prompts as one batch of `size` rows on the graphs → (the generations, the batch's counts)."""
    batch = Batch(stack, size, Sampling(), eos, cache_len=reach, path=LayerPath(stack, graphs),
                  shadow_with_acceptance=True)
    out: dict = {}

    def job(slot, i):
        out[i] = yield Request(prompts[i], copy.deepcopy(method), tokens, seed=0)

    counts = batch.run(range(len(prompts)), job)
    return [out[i] for i in range(len(prompts))], counts


def batch_row(label: str, stack, prompts, eos, method, tokens: int, size: int, loop: list) -> dict:
    reach = max(map(len, prompts)) + tokens + 1
    graphs, info = graphs_of(stack, method, tokens, reach, batch=size)
    (gens, counts), launched = launches(
        lambda n: batch_decode(stack, prompts, eos, method, n, size, graphs, reach), tokens)
    prefill_reads = sum(g.rounds[0].host_syncs for g in gens)  # each prompt's prefill: its row's alone
    rounds = counts["rounds"]
    return {"row": f"{label} B={size}", "batch_size": size, "rounds": rounds,
            "reads_per_round": (counts["reads"] - prefill_reads) / rounds,
            "prefill_reads": prefill_reads / len(gens),
            "reads_per_token": counts["reads"] / sum(len(g.output_ids) for g in gens),
            **{f"{k}_per_round": v / rounds for k, v in launched.items()},
            "equal_loop": sum(g.output_ids == ref.output_ids for g, ref in zip(gens, loop)), "outputs": len(prompts),
            "graphs": info.get("graphs")}


COLUMNS = [("row", "row", "", 22), ("rounds", "rounds", "d", 6), ("reads/round", "reads_per_round", ".3f", 11),
           ("prefill", "prefill_reads", ".2f", 7), ("reads/token", "reads_per_token", ".3f", 11),
           ("drafting", "drafting_rounds", ".2f", 8), ("replays/round", "replays_per_round", ".2f", 13),
           ("host ops/round", "host_ops_per_round", ".1f", 14), ("= loop", "equal_loop", "d", 6),
           ("graphs", "graphs", "d", 6), ("chains", "draft_chains", "d", 6)]


def parse_args(argv: list[str]):
    ap = h.parser("graph-reads", __doc__, runs=False)
    ap.add_argument("--model", default="testbed", help="testbed | tiny (the tests' TINY) | a model config")
    ap.add_argument("--dtype", default="float32", choices=("float32", "float64", "bfloat16"))
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4, help="B of the batch rows (Vanilla, LS; 1: none)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    args.device, args.shape = "cpu", None  # load_pair's: the stand-in runs where it is
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    _, model, prompts, eos, exit_layer = load_pair(args)
    stack = stack_of(model, layers="eager")
    tokens, reach = args.max_new_tokens, max(map(len, prompts)) + args.max_new_tokens + 1
    rows, loops = [], {}
    for label, method in methods(exit_layer):
        loops[label] = decode(stack, prompts, eos, method, tokens)  # the stack's loop: the tokens to equal
        graphs, info = graphs_of(stack, method, tokens, reach)
        rows.append(row(label, *launches_alone(stack, prompts, eos, method, tokens, graphs), loops[label], info))
        if label == "Vanilla":  # the same, its head after the step's graph (the engine before the token's tail)
            bare, bare_info = graphs_of(stack, method, tokens, reach, runner=HeadAfterGraph)
            rows.append(row(f"{label}, head after the graph",
                            *launches_alone(stack, prompts, eos, method, tokens, bare), loops[label], bare_info))
        if graphs.chain is not None:  # the same graphs, the host's loop drafting: a read per candidate
            chain, graphs.chain = graphs.chain, None
            rows.append(row(f"{label}, host's loop", *launches_alone(stack, prompts, eos, method, tokens, graphs),
                            loops[label], {**info, "draft_chains": None}))
            graphs.chain = chain
    if args.batch > 1:
        for label, method in methods(exit_layer)[:2]:
            rows.append(batch_row(label, stack, prompts, eos, method, tokens, args.batch, loops[label]))
    h.print_table(rows, COLUMNS, f"host reads on the captured path's stand-in: {args.model} {args.dtype}, "
                                 f"{len(prompts)} prompts × {tokens} tokens")
    print(json.dumps({r["row"]: round(r["reads_per_round"], 3) for r in rows}))
    h.write_result(args.out, "graph-reads", vars(args), rows=rows)
    return 0 if all(r["equal_loop"] == r["outputs"] for r in rows) else 1
