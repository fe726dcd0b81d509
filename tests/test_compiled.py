"""engine/compiled.py: static-shape steps built from LayerStack's public per-layer math, run as graphs — compiled whole
(fullgraph=True) or captured as CUDA graphs — lossless by the project's rule for every method and family.

Most tests compile with dynamo alone (fullgraph=True raises at any graph break; each new graph is counted); one
compiles with inductor (C++ codegen on CPU), the backend the engine uses off CUDA. The CUDA-graph runner's
bookkeeping (static buffers, composition, the captured cache, no host read inside a step) is replayed on the CPU by
a runner that records each step's body where CUDA would capture it."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch.utils._python_dispatch import TorchDispatchMode

from del_bench import runner
from del_bench.bench.graph_reads import HeadAfterGraph
from del_bench.bench.syncs import count_syncs
from del_bench.config import ConfigError, validate
from del_bench.engine import compiled, path_choice
from del_bench.engine.batch import Batch
from del_bench.engine.compiled import Graphs, StepShapes, bucket_of
from del_bench.engine.costs import measure_costs
from del_bench.engine.decode import Engine, Request
from del_bench.engine.graph_runners import RecordedRunner
from del_bench.engine.layer_path import LayerPath
from del_bench.engine.sampling import Sampling
from del_bench.engine.static_steps import RowSteps, StaticSteps, attended, attended_lengths, static_mask
from del_bench.methods.clasp import CLaSp
from del_bench.methods.dynamic_exit import DEL
from del_bench.methods.knapspec import KnapSpec
from del_bench.methods.ls import LayerSkip
from del_bench.methods.swift import Swift
from del_bench.methods.vanilla import Vanilla
from del_bench.models.layer_stack import LayerStack
from del_bench.numerics import compare
from del_bench.records import cost_units
from tests import test_batch
from tests.conftest import tiny_model
from tests.test_batch import BUDGETS, close, method, rounds_of
from tests.test_families import FAMILIES, PROMPTS, hf_greedy, tiny_family

# dynamo's whole-graph capture, run as captured: graph breaks and recompiles show here as under inductor, in a fraction
# of the time (inductor's own lowering and AOT's functionalisation of the cache writes: the inductor test below)
BACKEND = "eager"
PROMPT = "def add(a, b):\n"
TOKENS = 24
LONG = 250  # a prompt this long decodes across the first attended length (256 slots) within TOKENS
METHODS = {"vanilla": Vanilla(), "ls": LayerSkip(1, 5), "del": DEL(), "swift": Swift(context_window=8, seed=0),
           "clasp": CLaSp(skip_layers=1, interval=4), "knapspec": KnapSpec(warmup_rounds=1, interval=4)}


@pytest.fixture(scope="module")
def stack_and_prompt():
    model, tok = tiny_model()
    return LayerStack(model), tok(PROMPT)["input_ids"]


def long_prompt(prompt: list[int], length: int = LONG) -> list[int]:
    return (prompt * (length // len(prompt) + 1))[:length]


def attended_spy(graphs, monkeypatch) -> list[tuple[int, torch.Tensor, int | None]]:
    """Every step the graphs' functions run, recorded as (the key slots it attends over, its positions, and for a
    draft chain's pass the slots its round's budget may reach) — chains, sublayer steps, a batch's chains, draft
    chains' passes (read after the decode: no host read inside a step)."""
    seen: list[tuple[int, torch.Tensor, int | None]] = []
    functions = graphs.functions
    chain, attention, rows, draft_chain = functions.chain, functions.attention, functions.rows, graphs.draft_chain
    reach: list[int] = []  # while a draft chain replays: the slots its round may use

    def chain_spy(ws, h, positions, ks, vs, *args, **kwargs):
        seen.append((ks[0].shape[2], positions.clone(), reach[-1] if reach else None))
        return chain(ws, h, positions, ks, vs, *args, **kwargs)

    def attention_spy(w, h, positions, k, v):
        seen.append((k.shape[2], positions.clone(), None))
        return attention(w, h, positions, k, v)

    def rows_spy(ws, h, positions, live, ks, vs, *args, **kwargs):
        seen.append((ks[0].shape[2], positions.clone(), None))
        return rows(ws, h, positions, live, ks, vs, *args, **kwargs)

    def draft_chain_spy(exit_layer, pos, budget, cache):
        graph = draft_chain(exit_layer, pos, budget, cache)
        if graph is None:
            return None

        def replay():
            reach.append(pos + budget + 1)
            graph.replay()
            reach.pop()
        return type("Spied", (), {"replay": staticmethod(replay)})()

    for name, spy in (("chain", chain_spy), ("attention", attention_spy), ("rows", rows_spy)):
        monkeypatch.setattr(functions, name, spy)
    monkeypatch.setattr(graphs, "draft_chain", draft_chain_spy)
    return seen


def assert_attends_to_its_length(seen, max_len: int) -> set[int]:
    """Each step attended over the smallest attended length that holds the slots it used (positions 0..max; a draft
    chain's: the slots its round may reach): no more keys than that. → the lengths seen."""
    for length, positions, reach in seen:
        needed = reach if reach is not None else int(positions.max()) + 1
        assert length == attended(needed, max_len), (length, needed)
    return {length for length, _, _ in seen}


def decode(stack, prompt, method, tokens: int = TOKENS, graphs=None) -> list[int]:
    engine = Engine(stack, Sampling(), set(), path=LayerPath(stack, graphs))
    return engine.generate(prompt, copy.deepcopy(method), tokens, seed=0).output_ids


def set_costs(method, stack) -> None:
    if method.wants_costs:  # as the runner measures them (KnapSpec's latency model)
        costs = measure_costs(Engine(stack, Sampling(), set()), reps=1, batch_sizes=(1, 2),
                              contexts=method.latency_contexts)
        method.set_costs(**cost_units(costs))


class Replayed(RecordedRunner):
    """The CUDA-graph runner's bookkeeping replayed on the CPU (graph_runners.RecordedRunner), each replay under a
    host-read counter that must stay at zero; a conditional node's flag (a draft chain's) tested outside it — the
    device's test on CUDA."""

    replays = 0  # graphs replayed, all instances together

    def _capture(self, body, width):
        body()  # capture's warm-up writes, as on CUDA

        def replay():
            with count_syncs() as reads:
                body()
            assert reads.total == 0, f"a step read from the device: {reads.sites}"
            Replayed.replays += 1

        return type("Recorded", (), {"replay": staticmethod(replay)})()

    @staticmethod
    def when(flag, body):
        with torch._C.DisableTorchFunction():  # not seen by count_syncs' function mode
            taken = bool(flag)
        if taken:
            body()


def test_bucket_and_mask():
    assert [bucket_of(t) for t in (1, 2, 3, 5, 8, 9, 17, 33)] == [1, 2, 4, 8, 8, 16, 32, None]
    mask = static_mask(torch.tensor([[2, 3], [0, 1]]), 5)  # [B=2, 1, T=2, S=5]: each row at its own positions
    assert mask.shape == (2, 1, 2, 5)
    assert mask[0, 0].tolist() == [[True, True, True, False, False], [True, True, True, True, False]]
    assert mask[1, 0].tolist() == [[True, False, False, False, False], [True, True, False, False, False]]
    windowed = static_mask(torch.tensor([[4]]), 6, window=2)  # the last 2 positions, itself included
    assert windowed[0, 0, 0].tolist() == [False, False, False, True, True, False]
    # the attended lengths: 256, doubling, then the cache's own; a step attends over the smallest holding its slots
    assert attended_lengths(1024) == [256, 512, 1024] and attended_lengths(768) == [256, 512, 768]
    assert attended_lengths(64) == [64]
    assert [attended(n, 768) for n in (1, 256, 257, 513, 768)] == [256, 256, 512, 768, 768]
    with pytest.raises(ValueError, match="using 769 slots of a cache of 768"):
        attended(769, 768)


@pytest.mark.parametrize("name", METHODS, ids=list(METHODS))
def test_every_method_on_the_graphs_gives_eager_tokens(stack_and_prompt, name, monkeypatch):
    """compile=on, whole graphs (fullgraph): each method's greedy output is the eager engine's (float64), the layers
    counted where they ran are the rounds' own, every step the method calls was prepared (no graph made inside the
    decode: the compile counter stands still) and the graphs served it — early-exit chains, DEL's layer-by-layer
    steps with every layer's state kept, the skipping drafts' sublayer steps. The prompt's decode crosses from the
    first attended length (256 slots) to the next: each step attends over the smallest that holds its slots, and one
    graph serves both (the length is dynamic on this path)."""
    stack, prompt = stack_and_prompt
    prompt = long_prompt(prompt)
    method = METHODS[name]
    set_costs(method, stack)
    reference = decode(stack, prompt, method)
    counter = CompileCounterWithBackend(BACKEND)
    own = set(vars(stack))
    graphs, info = path_choice.choose_graphs(stack, "on", method, TOKENS, backend=counter)
    frames = counter.frame_count
    assert info["compiled"] and info["graph_kind"] == "compiled" and info["compile_s"] > 0
    assert set(vars(stack)) == own  # the engine holds its graphs: nothing of them is stored on the model's stack
    seen = attended_spy(graphs, monkeypatch)
    engine = Engine(stack, Sampling(), set(), path=LayerPath(stack, graphs))
    with stack.counting() as work:
        gen = engine.generate(prompt, copy.deepcopy(method), TOKENS, seed=0)
    assert gen.output_ids == reference
    assert work.layers == sum(r.loaded_layers for r in gen.rounds)
    assert counter.frame_count == frames  # prepared: nothing compiles inside a timed decode
    assert assert_attends_to_its_length(seen, engine.cache.max_len) == {256, 512}
    assert set(graphs.declined) <= {"steps wider than 32 positions", "steps of a shape not prepared",
                                    "a padded step past the cache's last slot"}
    assert graphs.declined.get("steps of a shape not prepared", 0) <= 1  # the prefill alone


def test_one_graph_serves_every_layer_and_position(stack_and_prompt):
    """The layer's tensors are arguments: a chain is its one layer function called layer by layer, compiled once per
    width, not once per layer, chain or position (dynamo guards on shapes, not on which layer's tensors) — DEL's
    chains for every exit layer it may choose (drafts 1..E at width 1, verifications E+1..L at each width, each
    keeping its states) and Vanilla's."""
    stack, prompt = stack_and_prompt
    L = stack.num_layers
    counter = CompileCounterWithBackend(BACKEND)
    graphs = Graphs(stack, backend=counter)
    graphs.prepare(StepShapes(None, 3, collects=True), 64)
    widths = [b for b in compiled.BUCKETS if b <= 4]
    assert counter.frame_count == len(widths)
    assert graphs.graphs == 2 + (L - 1) + (L - 1) * len(widths)  # [0, L) bare and keeping; [0, E); [E, L) a width


@torch.inference_mode()
def test_a_padded_verify_gives_the_eager_rows_and_cache(stack_and_prompt):
    """Three positions through layers E+1..L, padded to a bucket of 4: the three rows and every late layer's keys and
    values at their slots are the eager loop's (float64, up to summation order); NaN in every slot never written (as
    torch.empty may leave them) never reaches an output."""
    stack, prompt = stack_and_prompt
    E, L, P, T = 2, stack.num_layers, len(prompt), 3
    graphs = Graphs(stack, backend=CompileCounterWithBackend(BACKEND))
    caches = []
    for _ in range(2):
        cache = stack.new_cache(64)
        for k, v in zip(cache.k, cache.v):
            k.fill_(float("nan"))
            v.fill_(float("nan"))
        stack.forward_layers(stack.embed(torch.tensor([prompt])), 0, L, 0, cache)
        caches.append(cache)
    eager, static = caches
    ids = torch.tensor([[7, 11, 13]])
    states = stack.forward_layers(stack.embed(ids), 0, E, P, eager)  # [1, T, D] layer-E states
    stack.forward_layers(stack.embed(ids), 0, E, P, static)
    expected = stack.forward_layers(states, E, L, P, eager)
    out = graphs.forward_layers(states, E, L, P, static)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    assert static.lengths[E:] == [P + T] * (L - E)
    for i in range(E, L):
        torch.testing.assert_close(static.k[i][:, :, : P + T], eager.k[i][:, :, : P + T], rtol=0, atol=1e-12)
        torch.testing.assert_close(static.v[i][:, :, : P + T], eager.v[i][:, :, : P + T], rtol=0, atol=1e-12)


@torch.inference_mode()
def test_rows_of_a_batch_are_each_their_own(stack_and_prompt):
    """The steps carry a batch dimension (B rows, each at its own positions, in its own row of the cache): two rows of
    different lengths through all layers give what each gives alone, and write each only its own slots — a row that
    read another's positions or cache row would not."""
    stack, _ = stack_and_prompt
    steps, L, D = StaticSteps(stack), stack.num_layers, stack.embed_weight.shape[1]
    S, lengths = 16, (5, 9)
    gen = torch.Generator().manual_seed(1)
    h = [torch.randn(1, 2, D, generator=gen, dtype=stack.dtype) for _ in lengths]
    alone, batched = [], stack.new_cache(S)
    batched.k = [torch.zeros(2, *k.shape[1:], dtype=k.dtype) for k in batched.k]
    batched.v = [torch.zeros(2, *v.shape[1:], dtype=v.dtype) for v in batched.v]
    for row, n in enumerate(lengths):
        cache = stack.new_cache(S)
        for i in range(L):
            cache.k[i].zero_()
            cache.v[i].zero_()
            cache.k[i][:, :, :n].normal_(generator=gen)
            cache.v[i][:, :, :n].normal_(generator=gen)
            batched.k[i][row], batched.v[i][row] = cache.k[i][0], cache.v[i][0]
        positions = torch.arange(n, n + 2)[None]
        alone.append((steps.layers(stack.layers, h[row], positions, cache.k, cache.v), cache))
    positions = torch.stack([torch.arange(n, n + 2) for n in lengths])  # [2, 2]
    out = steps.layers(stack.layers, torch.cat(h), positions, batched.k, batched.v)
    for row, (expected, cache) in enumerate(alone):
        torch.testing.assert_close(out[row : row + 1], expected, rtol=0, atol=1e-12)
        for i in range(L):
            torch.testing.assert_close(batched.k[i][row], cache.k[i][0], rtol=0, atol=1e-12)


def test_inductor_step_gives_eager_tokens(stack_and_prompt):
    """The backend the engine uses off CUDA: inductor's C++ kernels. One graph (Vanilla's step: every layer, the cache
    writes, the masked SDPA) keeps the compile to seconds once inductor's on-disk cache is warm."""
    stack, prompt = stack_and_prompt
    graphs = Graphs(stack)
    graphs.prepare(StepShapes(None, 0), 64)
    assert decode(stack, prompt, Vanilla(), graphs=graphs) == decode(stack, prompt, Vanilla())
    assert graphs.graphs == 1 and graphs.compile_s > 0


@pytest.mark.parametrize("setting,kind", [("on", "fused_cuda_graphs"), ("graphs", "cuda_graphs")])
@pytest.mark.parametrize("name", ["vanilla", "ls", "del", "swift"])
def test_the_cuda_graph_runner_replays_the_engines_steps(stack_and_prompt, name, setting, kind, caplog):
    """The CUDA path's bookkeeping, replayed on the CPU, with the steps' kernels fused (compiled: on) or not (graphs):
    every step reads and writes its width's static buffers, so chains, layer-by-layer and sublayer steps compose; the
    engine decodes in the cache the graphs were captured on; no step reads from the device; the tokens are the eager
    engine's; a chain is one replay — DEL's too, its layers' states kept inside it, and its whole draft, the draft
    chain: a round replays its draft and one verification. A prompt longer than that cache decodes on the stack's
    loop, with a warning, the same tokens."""
    stack, prompt = stack_and_prompt
    method = METHODS[name]
    reference = decode(stack, prompt, method)
    graphs, info = path_choice.choose_graphs(stack, setting, method, TOKENS, cache_len=len(prompt) + TOKENS + 1,
                                             capture=True, runner=Replayed, backend=CompileCounterWithBackend(BACKEND))
    assert info["graph_kind"] == kind and graphs.cache.max_len == compiled.CACHE_QUANTUM
    engine = Engine(stack, Sampling(), set(), path=LayerPath(stack, graphs))
    chains, forward_layers, draft_chain = [], graphs.forward_layers, graphs.draft_chain
    graphs.forward_layers = lambda *a, **k: chains.append(forward_layers(*a, **k)) or chains[-1]
    graphs.draft_chain = lambda *a, **k: chains.append(draft_chain(*a, **k)) or chains[-1]
    before = Replayed.replays
    gen = engine.generate(prompt, copy.deepcopy(method), TOKENS, seed=0)
    del graphs.forward_layers, graphs.draft_chain
    assert gen.output_ids == reference
    if name in ("vanilla", "ls", "del"):  # early exit: each chain one replay (DEL's draft one), ≤ d + 2 a round
        replays = Replayed.replays - before
        assert replays == sum(out is not None for out in chains)
        assert replays <= sum(r.drafted + 2 for r in gen.rounds if r.round > 0)
        if name == "del":  # its whole draft one replay: a drafting round replays its draft chain and verification
            assert replays == sum(1 + (r.budget > 0) for r in gen.rounds if r.round > 0)
    assert engine.cache is graphs.cache
    long_prompt = prompt * (compiled.CACHE_QUANTUM // len(prompt) + 1)
    with caplog.at_level(logging.WARNING):
        assert engine.generate(long_prompt, copy.deepcopy(method), 4, seed=0).output_ids == \
            decode(stack, long_prompt, method)[:4]
    assert engine.cache is not graphs.cache and "were captured on" in caplog.text


class HeadOps(TorchDispatchMode):
    """Counts the head's ops (products, argmax) dispatched outside a recording's replay."""

    HEAD = {"aten.mm.default", "aten.matmul.default", "aten.addmm.default", "aten.argmax.default", "aten.bmm.default"}

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not RecordedRunner.replaying and str(func) in self.HEAD:
            self.ops += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["fp64", "bf16"])
def test_a_tokens_head_runs_inside_its_steps_graph(dtype):
    """At a batch of one on captured graphs a step ending at the last layer carries the token's tail (final norm, LM
    head, argmax, top-2: graph_runners.TokenTail) and LS's draft is a draft chain: a Vanilla or LS decode round
    launches no head product or argmax outside its replays (the same graphs without the tail: one a round at least).
    The same tokens, near-tie gaps (bf16: the head row by row inside the graph, as after it) and counted work — layers
    and head rows — as the head after the graph, and as the eager engine."""
    model, tok = tiny_model(dtype)
    stack, prompt = LayerStack(model), tok(PROMPT)["input_ids"]
    for decoding in (Vanilla(), LayerSkip(1, 5), DEL()):
        outs = {}
        for stand_in in (RecordedRunner, HeadAfterGraph):
            graphs, _ = path_choice.make_graphs(stack, "graphs", decoding, TOKENS, len(prompt) + TOKENS + 1,
                                                capture=True, runner=stand_in)
            engine = Engine(stack, Sampling(), set(), path=LayerPath(stack, graphs), shadow_with_acceptance=True)
            ops = []
            for tokens in (1, TOKENS):  # one token: the prefill alone; the rest: the decode rounds'
                with HeadOps() as head, stack.counting() as work:
                    gen = engine.generate(prompt, copy.deepcopy(decoding), tokens, seed=0)
                ops.append(head.ops)
            outs[stand_in] = (gen.output_ids, gen.top2_gap_ulps, dict(vars(work)), ops[1] - ops[0],
                            sum(r.round > 0 for r in gen.rounds))
        (ids, gaps, work, head_ops, rounds), (bare_ids, bare_gaps, bare_work, bare_ops, _) = outs.values()
        assert ids == bare_ids == decode(stack, prompt, decoding) and gaps == bare_gaps and work == bare_work
        assert bare_ops >= rounds
        if not decoding.wants_shadow:  # DEL scores its shadow tokens after the verification (ShadowScorer.ride)
            assert head_ops == 0, type(decoding).__name__


def test_a_batchs_heads_run_inside_its_steps_graph():
    """A batch's graphs (B = 2, replayed on the CPU) carry the token's tail for every row in a chain to the last layer
    (compiled.Graphs.rows, TokenTail.row): a Vanilla round launches no head product or argmax outside its replay;
    every method's rows decode the tokens, and count the work (layers, head rows), of the head after the graph, and
    each row its batch-1 tokens."""
    model, tok = tiny_model()
    stack = LayerStack(model)
    prompts = [tok(p)["input_ids"] for p in test_batch.PROMPTS[:2]]
    for decoding in (Vanilla(), LayerSkip(1, 5), DEL()):
        alone = [decode(stack, p, decoding) for p in prompts]
        outs = {}
        for stand_in in (RecordedRunner, HeadAfterGraph):
            graphs, _ = path_choice.make_graphs(stack, "graphs", decoding, TOKENS, 80, capture=True, runner=stand_in,
                                                batch=2)
            ops = []
            for tokens in (1, TOKENS):  # one token: the prefills alone; the rest: the decode rounds'
                batch = Batch(stack, 2, Sampling(), set(), cache_len=80, path=LayerPath(stack, graphs))
                out = {}

                def job(slot, i, tokens=tokens, out=out, decoding=decoding):
                    out[i] = yield Request(prompts[i], copy.deepcopy(decoding), tokens, seed=0)

                with HeadOps() as head, stack.counting() as work:
                    batch.run(range(2), job)
                ops.append(head.ops)
            outs[stand_in] = ([out[i].output_ids for i in range(2)], dict(vars(work)), ops[1] - ops[0])
        (ids, work, head_ops), (bare_ids, bare_work, bare_ops) = outs.values()
        assert ids == bare_ids == alone and work == bare_work and bare_ops > 0
        if isinstance(decoding, Vanilla):
            assert head_ops == 0


@pytest.mark.parametrize("name", ["vanilla", "del"])
def test_captured_graphs_attend_to_their_length_across_a_boundary(stack_and_prompt, name, monkeypatch):
    """CUDA graphs per attended length (the runner replayed on the CPU): on a cache captured for 512 slots a graph
    is made for 256 and for 512, each a view of the one cache; a decode that crosses slot 256 replays the 256-slot
    graphs, then the 512-slot ones — every replay attending over the smallest length that holds its slots — with
    the eager engine's tokens (chains, DEL's collecting chains and its draft chains, whose passes attend over the
    length that holds the slots their round's budget may reach — so DEL's prompt ends 20 slots earlier; sublayer
    steps take their length the same way: test_every_method_on_the_graphs_gives_eager_tokens[swift])."""
    stack, prompt = stack_and_prompt
    prompt, method = long_prompt(prompt, LONG - 20 if name == "del" else LONG), METHODS[name]
    reference = decode(stack, prompt, method)
    graphs, info = path_choice.choose_graphs(stack, "on", method, TOKENS, cache_len=LONG + TOKENS + 1,
                                             capture=True, runner=Replayed, backend=CompileCounterWithBackend(BACKEND))
    assert info["cache_slots"] == 512 and info["attended_lengths"] == [256, 512]
    assert {key[-1] for key in graphs.runner.made} == {256, 512}  # a graph per length, each prepared
    seen = attended_spy(graphs, monkeypatch)
    engine = Engine(stack, Sampling(), set(), path=LayerPath(stack, graphs))
    assert engine.generate(prompt, copy.deepcopy(method), TOKENS, seed=0).output_ids == reference
    assert engine.cache is graphs.cache and not graphs.declined.get("steps of a shape not prepared", 0) > 1
    assert assert_attends_to_its_length(seen, graphs.cache.max_len) == {256, 512}


def test_an_idle_query_sees_the_scratch_slot_alone():
    """A batch's row or column with no position sits at the scratch slot (the attended view's last): with idle=True
    its query sees that slot alone, so it reads no real key; a real query's mask is unchanged."""
    mask = static_mask(torch.tensor([[2, 7], [7, 7]]), 8, idle=True)  # [B=2, 1, T=2, S=8]; slot 7: the scratch
    assert mask[0, 0, 0].tolist() == [True] * 3 + [False] * 5
    assert mask[0, 0, 1].tolist() == mask[1, 0, 0].tolist() == [False] * 7 + [True]
    assert static_mask(torch.tensor([[7]]), 8)[0, 0, 0].all()  # without idle: a real query at slot 7 sees all


@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_family_runs_on_the_graphs_like_generate(name):
    """One layer math: the steps are LayerStack's per-layer functions, so each described family (biases, q/k norms,
    sandwich norms, windows shorter than the prompt, soft caps, per-layer rotary tables) runs on them — SWIFT's
    drafts on sublayer steps, its verification on whole-layer chains — equal to `generate` in float64 (Llama's every
    method: test_every_method_on_the_graphs_gives_eager_tokens)."""
    model = tiny_family(name)
    stack = LayerStack(model)
    method = Swift(skip_set={"attn": [1], "mlp": [2]}, d_max=2)
    graphs, _ = path_choice.choose_graphs(stack, "on", method, 20, backend=CompileCounterWithBackend(BACKEND))
    prompt = PROMPTS[0]  # longer than the window
    assert decode(stack, prompt, method, 20, graphs) == hf_greedy(model, prompt, 20)
    assert not graphs.declined.get("steps of a shape not prepared", 0) > 1  # the prefill at most


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_family_on_inductors_steps_is_generate(name):
    """compile=on on a CPU: inductor's C++ kernels (the fused steps a GPU captures are inductor's Triton ones), each
    family's greedy decode with LS equal to `generate` in float64 (~20 s a family: the compile)."""
    model = tiny_family(name)
    stack = LayerStack(model)
    method = LayerSkip(1, 2)
    graphs, info = path_choice.choose_graphs(stack, "on", method, 12)
    assert info["graph_kind"] == "compiled" and graphs.functions.fused
    prompt = PROMPTS[0]
    assert decode(stack, prompt, method, 12, graphs) == hf_greedy(model, prompt, 12)


def test_half_precision_is_held_to_the_near_tie_rule():
    """bfloat16 on the CPU: the graphs attend a verification batch as one (the eager loop goes row by row for a decode
    step's bits), so their bits differ from every other kernel's; `check` accepts them because each greedy decode
    equals generate's or first departs at a near-tie of generate's logits (numerics.compare), and so does a run."""
    model, tok = tiny_model(torch.bfloat16)
    stack = LayerStack(model)
    method = LayerSkip(1, 3)
    graphs, info = path_choice.choose_graphs(stack, "on", method, 16, backend=CompileCounterWithBackend(BACKEND))
    assert info["compiled"], info
    prompt = tok(PROMPT)["input_ids"]
    engine = Engine(stack, Sampling(), set(), path=LayerPath(stack, graphs))
    gen = engine.generate(prompt, copy.deepcopy(method), 16, seed=0)
    reference, gaps = path_choice.generate_reference(model, prompt, 16)
    assert compare(gen.output_ids, reference, gaps).lossless


def test_check_applies_the_rule_of_the_dtype(stack_and_prompt, monkeypatch):
    """check's verdict against generate: in half precision a first departure at a near-tie of generate's logits
    passes and one at a clear preference fails; in float32/float64 any departure fails (no near-tie excuse)."""
    stack, _ = stack_and_prompt
    graphs = Graphs(stack, backend=CompileCounterWithBackend(BACKEND))
    graphs.prepare(StepShapes(None, 0), 64)
    ours = []

    def reference_departing_at(position: int, gap: float):
        def reference(model, prompt, tokens):
            ours[:] = [decode(stack, prompt, Vanilla(), tokens)]
            out = list(ours[0])
            out[position] = (out[position] + 1) % stack.vocab_size
            return out, [100.0] * position + [gap] + [100.0] * (tokens - position - 1)
        return reference

    monkeypatch.setattr(path_choice, "generate_reference", reference_departing_at(3, 100.0))
    assert "departs from generate's at token 3" in path_choice.check(stack, graphs, Vanilla())
    monkeypatch.setattr(path_choice, "generate_reference", reference_departing_at(3, 1.0))
    assert "at token 3" in path_choice.check(stack, graphs, Vanilla())  # float64: a near-tie excuses nothing
    monkeypatch.setattr(path_choice, "is_half", lambda dtype: True)
    assert path_choice.check(stack, graphs, Vanilla()) is None  # half precision: a near-tie departure is lossless
    monkeypatch.setattr(path_choice, "generate_reference", reference_departing_at(3, 100.0))
    assert path_choice.check(stack, graphs, Vanilla()) is not None


def test_compile_off_auto_off_cuda_and_bad_settings(stack_and_prompt):
    """off, and auto (the default) on a CPU: the stack's loop, nothing compiled (auto captures on CUDA only)."""
    stack, _ = stack_and_prompt
    assert path_choice.choose_graphs(stack, "off", Vanilla(), TOKENS) == (None, {"compile": "off", "compiled": False})
    graphs, auto = path_choice.choose_graphs(stack, "auto", Vanilla(), TOKENS)
    assert graphs is None and not auto["compiled"] and "CUDA only" in auto["reason"]
    with pytest.raises(ValueError, match="compile='sometimes'"):
        path_choice.choose_graphs(stack, "sometimes", Vanilla(), TOKENS)
    assert path_choice.unsupported(stack) is None


def test_a_run_validates_and_records_its_compile_setting(run_cfg):
    """compile is validated before the model loads (a boolean, as YAML reads a bare off, is off or on), and the run's
    setup line says what was chosen: auto by default, which on a CPU leaves the samples to the stack's loop alone."""
    with pytest.raises(ConfigError, match="compile='sometimes': must be one of off, auto, on"):
        validate(run_cfg("method=vanilla", "compile=sometimes"))
    validate(run_cfg("method=vanilla", "compile=false"))  # a boolean: off
    summary = runner.run(run_cfg("method=vanilla", "limit=1", "max_new_tokens=4", "layers=eager"))
    (setup,) = summary["setup"]
    assert setup["compile"] == "auto" and setup["compiled"] is False
    assert summary["provenance"]["layer_path"] == "eager"


@pytest.mark.slow
def test_a_run_with_compile_on_decodes_on_the_steps_and_says_so(run_cfg):
    """compile=on through the runner (inductor): the graphs are made before the timed samples (compile_s in the setup
    line), the records say `eager+compiled` and so the run never pairs with an eager one (RunKey.machine)."""
    cfg = run_cfg("method=ls", "method.exit_layer=2", "method.gamma=2", "limit=1", "max_new_tokens=8", "layers=eager",
                  "compile=on")
    summary = runner.run(cfg)
    (setup,) = summary["setup"]
    assert setup["compiled"] is True and setup["compile_s"] > 0 and setup["graphs"] >= 3
    assert summary["provenance"]["layer_path"] == "eager+compiled"
    assert "eager+compiled layers" in summary["run_key"]["machine"]


# ---- a batch's steps (engine/batch.py): graphs per (B, width bucket) --------------------------------------------
@pytest.mark.parametrize("setting,kind", [("on", "fused_cuda_graphs"), ("graphs", "cuda_graphs")])
@pytest.mark.parametrize("case", ["vanilla", "ls", "del", "clasp"])
def test_the_cuda_graph_runner_replays_a_batchs_steps(case, setting, kind):
    """A batch's steps captured (replayed on the CPU, fused and unfused): B = 4 rows of prompts and answers of
    different lengths, each row's tokens and rounds its batch-1 ones; every chain one replay of its (B, width) graph —
    a Vanilla round is one replay for the whole batch — with no host read inside a step; nothing declined; the rows
    decode in the cache the graphs were captured on."""
    model, tok = tiny_model()
    stack = LayerStack(model)
    prompts = [tok(p)["input_ids"] for p in test_batch.PROMPTS]
    m = method(case)
    engine = Engine(stack, Sampling(), set())
    alone = [engine.generate(p, copy.deepcopy(m), n, seed=i) for i, (p, n) in enumerate(zip(prompts, BUDGETS))]
    graphs, info = path_choice.make_graphs(stack, setting, m, max(BUDGETS), 80,
                                           backend=CompileCounterWithBackend(BACKEND), capture=True, runner=Replayed,
                                           batch=4)
    assert info["compiled"] and info["graph_kind"] == kind and graphs.cache.k[0].shape[0] == 4
    batch = Batch(stack, 4, Sampling(), set(), cache_len=80, path=LayerPath(stack, graphs))
    out, steps = {}, []

    def decode(slot, i):
        out[i] = yield Request(prompts[i], copy.deepcopy(m), BUDGETS[i], seed=i)

    rows = graphs.rows
    graphs.rows = lambda *a, **k: steps.append(rows(*a, **k)) or steps[-1]
    before = Replayed.replays
    stats = batch.run(range(len(prompts)), decode)
    for i, one in enumerate(alone):
        assert out[i].output_ids == one.output_ids
        assert close(rounds_of(out[i]), rounds_of(one))
    assert Replayed.replays - before == len(steps) and None not in steps and not graphs.declined
    if case == "vanilla":
        assert len(steps) == stats["rounds"]
    assert batch.cache is graphs.cache


def test_a_batchs_graphs_are_the_chains_its_rounds_can_call(stack_and_prompt):
    """DEL (its exit layer chosen per round, every layer's states kept): the drafts' chain to each exit layer (and to
    L: a row with no draft) at width 1, the verification's from each exit layer at every width up to its budget's."""
    stack, _ = stack_and_prompt
    L = stack.num_layers
    graphs = Graphs(stack, backend=CompileCounterWithBackend(BACKEND), capture=True, runner=Replayed, batch=2)
    graphs.prepare_rows(StepShapes(None, 3, collects=True), 64)
    widths = [b for b in compiled.BUCKETS if b <= 4]
    assert graphs.graphs == L + (L - 1) * len(widths)
    assert graphs.cache.k[0].shape[:3] == (2, stack.n_kv_heads, compiled.CACHE_QUANTUM)


@pytest.mark.parametrize("case", ["vanilla", "clasp"])
def test_a_batchs_graphs_grow_with_a_longer_request_and_attend_to_their_length(case, monkeypatch, caplog):
    """A batch's CUDA graphs (replayed on the CPU) captured for short requests (a cache of 256 slots): a request too
    long for it, admitted mid-run, has the graphs made again on a longer captured cache (Graphs.grow: recorded in
    `regrown`, logged) — never the eager steps — the other row's filled slots carried over; its decode crosses slot
    256, each step's graph attending over a view of 256 or 512 slots whose last, the scratch slot, lies beyond every
    real position; every row's tokens are its batch-1 ones."""
    model, tok = tiny_model()
    stack = LayerStack(model)
    short = [tok(p)["input_ids"] for p in test_batch.PROMPTS[:3]]
    prompts, budgets = [*short, long_prompt(short[0])], [6, 9, 12, TOKENS]
    m = method(case)
    engine = Engine(stack, Sampling(), set())
    alone = [engine.generate(p, copy.deepcopy(m), n, seed=i).output_ids for i, (p, n) in enumerate(zip(prompts,
                                                                                                         budgets))]
    graphs, _ = path_choice.make_graphs(stack, "on", m, max(budgets), 80, CompileCounterWithBackend(BACKEND),
                                        capture=True, runner=Replayed, batch=2)
    assert graphs.cache.max_len == 256
    batch = Batch(stack, 2, Sampling(), set(), cache_len=80, path=LayerPath(stack, graphs))
    seen = attended_spy(graphs, monkeypatch)
    monkeypatch.setattr(RowSteps, "_eager", lambda *a, **k: pytest.fail("a batch's step ran eagerly"))
    out = {}

    def decode(slot, i):
        out[i] = (yield Request(prompts[i], copy.deepcopy(m), budgets[i], seed=i)).output_ids

    with caplog.at_level(logging.WARNING):
        batch.run(range(len(prompts)), decode)
    assert [out[i] for i in range(len(prompts))] == alone
    assert graphs.regrown == [(256, 512)] and "made again on 512" in caplog.text
    assert batch.cache is graphs.cache and graphs.cache.max_len == 512 and not graphs.declined
    for length, positions, _ in seen:
        assert int(positions[positions != length - 1].max()) < length - 1
    assert {length for length, _, _ in seen} == {256, 512}
