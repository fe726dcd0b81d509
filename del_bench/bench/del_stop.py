"""DEL's stop on τ four ways on a GPU: a read per candidate, CUDA graph conditional nodes, masked continuation, ideal.

Issue 51 asks where DEL's stop decision should be made: today the engine reads every draft candidate's confidence to
the host before it launches the next (`Round.host_syncs` = 1 + candidates a round; 3.7 on the H200, where DEL ran at
0.87 of its memory-bound prediction and LS at 0.98). This bench measures the ways out on one draft step at a model's
layer shape — the token's embedding, layers 1..E (norms, the products, the key and value written in place into a
cache, attention over its live slots, SiLU), the exit head, the candidate (argmax) and its confidence (top softmax
probability in float32), the stop flag updated on the device — drafted until the stop at candidate d of a budget K:

- read: one graph a step, replayed, the flag read to the host before the next step is launched (the engine today);
- conditional: one graph of K steps, each inside a CUDA graph conditional node on the device's flag
  (`torch.cuda.CUDAGraph.begin_capture_to_if_node`, CUDA ≥ 12.4), so steps past the stop are skipped on the
  device; one read;
- masked: one graph of K steps run whatever the flag (masked continuation: the K − d steps past the stop are
  wasted, as `method.lookahead=K` wastes them); one read;
- ideal: one graph of exactly d steps (the stop known in advance: a lower bound).

The layer is written plainly here with random weights (a Llama layer's products and in-place cache writes, RoPE left
out), not the engine's step functions: what is measured is what the round's control flow costs, which does not depend
on whose kernels the steps run. The stop is the step count (the flag falls at step d; it also ANDs confidence ≥ −1,
so the comparison DEL makes is computed), so every way drafts the same d candidates.

Per way and d: ms a round by the host clock around the whole round (reset, steps, the read of the candidates: a
read's wait is what is measured), the ways interleaved rep by rep, the median of --reps; and whether each way's d
candidates and confidences equal read's bit for bit (the same kernels on the same inputs). On a CPU (the dry run:
--device cpu --shape tiny) there are no graphs: each way runs its steps eagerly, a conditional step behind a host
test of the flag — its times say nothing of a GPU; the outputs' equality and the steps each way ran are checked."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from del_bench.bench import harness as h

WAYS = ("read", "conditional", "masked", "ideal")


@dataclass(frozen=True)
class Shape:
    hidden: int
    ffn: int
    heads: int
    vocab: int
    exit_layer: int  # E: layers a draft step runs
    cache: int  # slots in each layer's key and value cache
    position: int  # the first draft's position (the slots before it are the context attended)


SHAPES = {"llama2-7b": Shape(4096, 11008, 32, 32000, 8, 512, 256), "tiny": Shape(64, 128, 4, 256, 2, 32, 12)}


class DraftStep:
    """One draft candidate's step on static buffers, so that graphs of it compose: reads the pending token, the base
    position and the step index, writes the candidate and confidence at the step index, the next token, the flag."""

    def __init__(self, shape: Shape, budget: int, dtype: torch.dtype, device: torch.device, seed: int = 0):
        gen = torch.Generator(device=device).manual_seed(seed)

        def weight(*size):  # scaled so that activations stay O(1) through the layers
            return (torch.randn(*size, generator=gen, device=device) * size[-1] ** -0.5).to(dtype)

        D, heads = shape.hidden, shape.heads
        self.shape, self.budget, self.head_dim = shape, budget, D // heads
        self.embed, self.head, self.final_norm = weight(shape.vocab, D) * D**0.5, weight(shape.vocab, D), \
            torch.ones(D, dtype=dtype, device=device)
        self.layers = [{"qkv": weight(3 * D, D), "o": weight(D, D), "gate_up": weight(2 * shape.ffn, D),
                        "down": weight(D, shape.ffn), "attn_norm": torch.ones(D, dtype=dtype, device=device),
                        "mlp_norm": torch.ones(D, dtype=dtype, device=device),
                        "k": weight(heads, shape.cache, self.head_dim), "v": weight(heads, shape.cache, self.head_dim)}
                       for _ in range(shape.exit_layer)]  # the cache holds random (finite) context
        self.slots = torch.arange(shape.cache, device=device)
        self.token = torch.zeros(1, dtype=torch.long, device=device)
        self.position = torch.full((1,), shape.position, dtype=torch.long, device=device)
        self.index = torch.zeros(1, dtype=torch.long, device=device)  # the step's: candidates so far
        self.stop_at = torch.zeros(1, dtype=torch.long, device=device)
        self.go = torch.ones((), dtype=torch.bool, device=device)  # keep drafting: the conditional nodes' predicate
        self.candidates = torch.zeros(budget, dtype=torch.long, device=device)
        self.confidences = torch.zeros(budget, dtype=torch.float32, device=device)

    def reset(self, d: int) -> None:
        """A new round that stops after d candidates (device fills: no transfer waits)."""
        self.token.fill_(1)
        self.index.zero_()
        self.go.fill_(True)
        self.stop_at.fill_(d)

    def step(self) -> None:
        at = self.position + self.index  # [1]
        live = self.slots <= at  # [S]: the context and the drafts so far
        h = self.embed[self.token]  # [1, D]
        for layer in self.layers:
            h = h + self._attention(layer, _norm(h, layer["attn_norm"]), at, live)
            gate, up = (_norm(h, layer["mlp_norm"]) @ layer["gate_up"].T).chunk(2, dim=-1)  # [1, F] each
            h = h + (F.silu(gate) * up) @ layer["down"].T
        logits = (_norm(h, self.final_norm) @ self.head.T).float()  # [1, V]
        confidence, candidate = logits.softmax(-1).max(-1)  # [1], [1]
        self.token.copy_(candidate)
        self.candidates.index_copy_(0, self.index, candidate)
        self.confidences.index_copy_(0, self.index, confidence)
        self.go.logical_and_(((self.index + 1 < self.stop_at) & (confidence >= -1.0)).squeeze(0))
        self.index.add_(1)

    def _attention(self, layer: dict, x: torch.Tensor, at: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
        heads, hd = self.shape.heads, self.head_dim
        q, k, v = (x @ layer["qkv"].T).view(3, heads, 1, hd)  # [H, 1, hd] each
        layer["k"].index_copy_(1, at, k)  # in place at the step's slot
        layer["v"].index_copy_(1, at, v)
        out = F.scaled_dot_product_attention(q, layer["k"], layer["v"], attn_mask=live)  # [H, 1, hd]
        return out.reshape(1, heads * hd) @ layer["o"].T

    def read(self) -> tuple[list[int], list[float], int]:
        """The round's one read: its candidates, confidences and how many steps ran."""
        values = torch.cat([self.candidates.double(), self.confidences.double(), self.index.double()]).tolist()
        K = self.budget
        return [int(x) for x in values[:K]], values[K : 2 * K], int(values[-1])


def _norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps=1e-5)


class Rounds:
    """Each way's round as a zero-argument function → (candidates, confidences, steps run, host reads): on CUDA its
    steps captured as graphs (one memory pool), elsewhere run eagerly."""

    def __init__(self, drafter: DraftStep, stops: list[int]):
        self.drafter = drafter
        self.cuda = drafter.token.device.type == "cuda"
        self.pool = torch.cuda.graph_pool_handle() if self.cuda else None
        self.conditional_error: str | None = None
        self.tests = 0  # the host's tests of the flag where no conditional node makes them (eager)
        K = drafter.budget
        self.one = self._program(drafter.step)
        self.masked = self._program(lambda: [drafter.step() for _ in range(K)])
        self.ideal = {d: self._program(lambda d=d: [drafter.step() for _ in range(d)]) for d in stops}
        try:
            self.conditional = self._program(self._conditional_steps)
        except Exception as err:  # no conditional nodes here (CUDA < 12.4, an older torch): the others still measure
            self.conditional, self.conditional_error = None, f"{type(err).__name__}: {err}"

    def _conditional_steps(self) -> None:
        for _ in range(self.drafter.budget):
            if self.cuda and torch.cuda.is_current_stream_capturing():
                graph = torch.cuda.CUDAGraph.get_currently_capturing_graph()
                graph.begin_capture_to_if_node(self.drafter.go)
                try:
                    self.drafter.step()
                finally:
                    graph.end_capture_to_conditional_node()
            else:  # eagerly (a CPU, the warm-up): the host tests the flag, a read each
                self.tests += 1
                if bool(self.drafter.go):
                    self.drafter.step()

    def _program(self, body: Callable[[], object]) -> Callable[[], None]:
        """body replayable: on CUDA warmed up on a side stream, then captured into a graph; elsewhere body itself."""
        if not self.cuda:
            return body
        self.drafter.reset(self.drafter.budget)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            body()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        self.drafter.reset(self.drafter.budget)
        with torch.cuda.graph(graph, pool=self.pool):
            body()
        return graph.replay

    def way(self, name: str, d: int) -> Callable[[], tuple] | None:
        drafter = self.drafter

        def read_each():
            drafter.reset(d)
            reads = 0
            for _ in range(drafter.budget):
                self.one()
                reads += 1
                if not bool(drafter.go):  # the engine's read: the candidate's stop decision on the host
                    break
            return *drafter.read(), reads + 1  # + the round's read of its candidates (acceptance's, in the engine)

        def once(program):
            def run():
                drafter.reset(d)
                self.tests = 0
                program()
                return *drafter.read(), self.tests + 1
            return run

        if name == "read":
            return read_each
        if name == "conditional":
            return once(self.conditional) if self.conditional is not None else None
        return once(self.masked if name == "masked" else self.ideal[d])


def measure(shape: Shape, budget: int, stops: list[int], reps: int, dtype: torch.dtype, device: torch.device) -> dict:
    """Every way at every stop d: outputs against read's, steps run, host reads, ms a round (interleaved)."""
    drafter = DraftStep(shape, budget, dtype, device)
    t0 = time.perf_counter()
    rounds = Rounds(drafter, stops)
    setup_s = time.perf_counter() - t0
    rows = []
    for d in stops:
        fns = {name: fn for name in WAYS if (fn := rounds.way(name, d)) is not None}
        outputs = {name: fn() for name, fn in fns.items()}  # also the warm-up of each way
        seconds: dict[str, list[float]] = {name: [] for name in fns}
        for _ in range(reps):
            for name, fn in fns.items():
                h._synchronize_accelerator()
                t = time.perf_counter()
                fn()  # ends with a read: the device is done when it returns
                seconds[name].append(time.perf_counter() - t)
        cands, confs, _, _ = outputs["read"]
        for name in WAYS:
            if name not in fns:
                rows.append({"d": d, "way": name, "not_run": rounds.conditional_error})
                continue
            c, p, ran, reads = outputs[name]
            rows.append({"d": d, "way": name, "ms": 1000 * statistics.median(seconds[name]), "steps": ran,
                         "reads": reads, "equal_read": c[:d] == cands[:d] and p[:d] == confs[:d]})
    ideal = {r["d"]: r["ms"] for r in rows if r["way"] == "ideal"}
    for r in rows:
        if "ms" in r:
            r["over_ideal"] = r["ms"] / ideal[r["d"]]
    return {"rows": rows, "setup_s": setup_s, "conditional_error": rounds.conditional_error}


def parse(argv):
    ap = argparse.ArgumentParser(prog="python -m del_bench bench del-stop", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama2-7b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                    help="default: bfloat16 on CUDA, float32 elsewhere")
    ap.add_argument("--budget", type=int, default=10, help="K: draft steps a round may take (DEL's d_max)")
    ap.add_argument("--stops", default="1,3,6", help="the d's: candidates drafted before the stop (each ≤ K)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default=None, help="the result JSON")
    args = ap.parse_args(argv)
    args.stops = [int(x) for x in args.stops.split(",")]
    if not args.stops or min(args.stops) < 1 or max(args.stops) > args.budget:
        ap.error(f"--stops must lie in 1..--budget ({args.budget}): {args.stops}")
    return args


COLUMNS = [("d", "d", "d", 3), ("way", "way", "", 11), ("ms", "ms", ".3f", 8), ("÷ideal", "over_ideal", ".3f", 7),
           ("steps", "steps", "d", 5), ("reads", "reads", "d", 5), ("= read", "equal_read", "", 6)]


def main(argv: list[str]) -> int:
    args = parse(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    shape = SHAPES[args.shape]
    with torch.inference_mode():
        result = measure(shape, args.budget, args.stops, args.reps, dtype, device)
    h.print_table(result["rows"], COLUMNS, f"DEL's stop four ways: {args.shape} shape, E = {shape.exit_layer}, "
                  f"K = {args.budget}, {dtype}, {device}" + ("" if device.type == "cuda" else
                                                             " (eager: times say nothing of a GPU)"))
    if result["conditional_error"]:
        print(f"conditional nodes not run: {result['conditional_error']}")
    if args.out:
        h.write_result(args.out, "del-stop", {**vars(args), "shape": asdict(shape), "dtype": str(dtype)}, **result,
                       device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")
    return 0 if all(r.get("equal_read", True) for r in result["rows"]) else 1
