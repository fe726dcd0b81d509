"""What the batch does per row when its rows differ within one step (engine/batch.py): rows at different exit layers,
draft lengths and skip sets in the same steps, each with its own exit head, decode exactly what each decodes alone —
on the eager static steps (RowSteps: every running row computed, an idle one masked, its keys to a scratch slot) and
on the fused loop's ragged steps (LayerStack.forward_rows: only the rows that run a sublayer computed). An idle row
writes nothing but the scratch slot, which lies beyond every slot any row holds or may write this round (its draft
budget's included); the graphs of a batch are checked row by row, every row; the compiled batch runner keeps the
graphs it made. Each test names the bug it was seen to catch."""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from del_bench.engine import path_choice
from del_bench.engine.batch import Batch
from del_bench.engine.decode import Engine, Request
from del_bench.engine.layer_path import LayerPath
from del_bench.engine.path_choice import stack_of
from del_bench.engine.sampling import Sampling
from del_bench.engine.static_steps import RowSteps, StepRows
from del_bench.methods.dynamic_exit import DEL
from del_bench.methods.ls import LayerSkip
from del_bench.methods.swift import Swift
from del_bench.models.layer_stack import LayerStack
from tests.conftest import tiny_model
from tests.test_batch import PROMPTS, close, rounds_of
from tests.test_engine import hf_greedy
from tests.test_exit_adapters import random_adapters

BUDGETS = [14, 9, 18, 6, 12, 16]
MIXED = {  # one method a row: four exit layers' and draft lengths' worth of early exit, or three skip sets
    "early exit": [LayerSkip(1, 3), LayerSkip(2, 2), LayerSkip(3, 1), DEL(), DEL(exit_layer=2), LayerSkip(1, 5)],
    "skip sets": [Swift(skip_set={"attn": [1], "mlp": [2]}, optimise=False),
                  Swift(skip_set={"attn": [2], "mlp": [1, 2]}, optimise=False),
                  Swift(skip_set={"attn": [], "mlp": [1]}, optimise=False),
                  Swift(skip_set={"attn": [1, 2], "mlp": []}, optimise=False, tree=True),
                  Swift(skip_set={"attn": [1], "mlp": [2]}, optimise=False),
                  Swift(skip_set={"attn": [2], "mlp": []}, optimise=False)],
}


@pytest.fixture(scope="module", params=["eager", "fused"])
def stacks(request):
    """(stack on that loop, stack with random exit adapters, prompt ids, generate's answers) in float64."""
    model, tok = tiny_model()
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    refs = [hf_greedy(model, p, n) for p, n in zip(prompts, BUDGETS)]
    adapted = stack_of(tiny_model()[0], layers=request.param)
    adapted.set_adapters(random_adapters(adapted.norm_weight.shape[0]))
    return stack_of(model, layers=request.param), adapted, prompts, refs


def mixed_batch(stack, prompts, methods, size=4, spy=None):
    """Each prompt i decoded by methods[i] in one batch of `size` slots → (generations, the steps' passes)."""
    batch = Batch(stack, size, Sampling(), set(), cache_len=48)
    steps, step = [], batch.step

    def spied(passes, collect=None, tails=None):
        steps.append([(p.start, p.end, p.skip) for p in passes.values()])
        return step(passes, collect, tails)

    batch.step = spied
    out = {}

    def decode(slot, i):
        out[i] = yield Request(prompts[i], copy.deepcopy(methods[i]), BUDGETS[i], seed=i)

    batch.run(range(len(prompts)), decode)
    return [out[i] for i in range(len(prompts))], steps


def alone(stack, prompts, methods):
    engine = Engine(stack, Sampling(), set())
    return [engine.generate(p, copy.deepcopy(m), n, seed=i) for i, (p, m, n) in enumerate(zip(prompts, methods,
                                                                                                  BUDGETS))]


@pytest.mark.parametrize("kind", MIXED)
def test_rows_at_different_exits_and_skip_sets_in_one_step_decode_as_alone(stacks, kind):
    """Mutants caught: the exit head of the first row's layer for every row (Batch.head with exits[0]); a row's
    states read at the deepest row's depth instead of its own (early_exit._layers taking out at `end`)."""
    stack, _, prompts, refs = stacks
    methods = MIXED[kind]
    single = alone(stack, prompts, methods)
    gens, steps = mixed_batch(stack, prompts, methods)
    for i, (one, gen) in enumerate(zip(single, gens)):
        assert gen.output_ids == one.output_ids == refs[i], f"row {i}"
        assert close(rounds_of(gen), rounds_of(one)), f"row {i}: its rounds differ from batch 1's"
    mixed = [s for s in steps if len({(a, b, None if k is None else (k.attn, k.mlp)) for a, b, k in s}) > 1]
    assert len(mixed) > 5  # rows at different depths / skip sets in one step, many times (not vacuous)


def test_every_row_drafts_from_its_own_exit_head(stacks):
    """Exit adapters: each row's draft head is its own exit layer's adapter, in the batch's one head product.
    Mutant caught: Batch.head applying the first row's exit layer to every row."""
    _, adapted, prompts, _ = stacks
    methods = [LayerSkip(1, 3), LayerSkip(2, 2), DEL(), LayerSkip(3, 2), DEL(exit_layer=1), LayerSkip(2, 4)]
    single = alone(adapted, prompts, methods)
    gens, _ = mixed_batch(adapted, prompts, methods)
    for one, gen in zip(single, gens):
        assert gen.output_ids == one.output_ids and close(rounds_of(gen), rounds_of(one))
    assert sum(r.adapter_rows for g in gens for r in g.rounds) > 0


def test_an_idle_row_writes_only_the_scratch_slot_beyond_what_any_row_holds():
    """RowSteps (eager): two rows step at positions 5 and 6 while a third, holding 100 positions, idles; the idle row's
    keys go to the scratch slot, past every slot held (`held`), and no row's other slot changes. Mutant caught: the
    scratch slot placed from the step's positions alone (held ignored: slot 63, inside the idle row's prompt)."""
    stack = LayerStack(tiny_model()[0])
    cache = stack.new_cache(160, batch=3)
    for k in cache.k + cache.v:
        k.normal_()
    before = [k.clone() for k in cache.k + cache.v]
    h = torch.randn(3, 1, stack.norm_weight.shape[0], dtype=stack.dtype)  # [3, 1, D]; row 2 idles (no position)
    L = stack.num_layers
    RowSteps(stack, cache).run(0, L, h, StepRows([5, 6, 0], [1, 1, 0], [0, 0, 0], [L, L, 0], held=100))
    for old, new in zip(before, cache.k + cache.v):
        changed = (old != new).any(-1).any(1)  # [3, S]: slots written, per row
        assert changed[0].nonzero().flatten().tolist() == [5] and changed[1].nonzero().flatten().tolist() == [6]
        written = changed[2].nonzero().flatten().tolist()
        assert len(written) == 1 and written[0] >= 100  # its scratch slot, past what it holds


def test_the_scratch_slot_lies_beyond_every_rows_draft_budget(monkeypatch):
    """Every static step of a round places the scratch slot beyond `held`, which must exceed every position any row
    writes in the round — its drafts' included, though a row's later steps idle. Mutant caught: held as the rows'
    sequences alone (Batch._round ignoring the budgets)."""
    stack = LayerStack(tiny_model()[0])  # the eager static steps (RowSteps)
    prompts = [tiny_model()[1](p)["input_ids"] for p in PROMPTS]
    log, run, round_ = [], RowSteps.run, Batch._round

    def spy(self, start, end, h, rows, *args, **kwargs):
        log[-1].append((rows.held, max(f + c - 1 for f, c in zip(rows.first, rows.count))))
        return run(self, start, end, h, rows, *args, **kwargs)

    def rounds(self, slots):
        log.append([])
        round_(self, slots)

    monkeypatch.setattr(RowSteps, "run", spy)
    monkeypatch.setattr(Batch, "_round", rounds)
    gens, _ = mixed_batch(stack, prompts, [LayerSkip(1, 6), LayerSkip(2, 3), DEL(), LayerSkip(1, 2), DEL(),
                                           LayerSkip(3, 4)], size=3)
    assert sum(map(len, log)) > 20
    for steps in log:
        written = max((p for _, p in steps), default=-1)
        assert all(held > written for held, _ in steps)


def test_a_batchs_graphs_are_held_to_generate_on_every_row(monkeypatch):
    """check_rows judges each row against generate on its own prompt: a departure in the third row is refused.
    Mutant caught: only the first row compared."""
    model, _ = tiny_model()
    stack = LayerStack(model)
    graphs, _ = path_choice.make_graphs(stack, "on", LayerSkip(1, 2), 16, 64,
                                        backend=CompileCounterWithBackend("eager"), batch=4)
    assert path_choice.check_rows(stack, graphs, LayerSkip(1, 2)) is None
    real, calls = path_choice.generate_reference, []

    def wrong_third(model, prompt, tokens):
        calls.append(prompt)
        out, gaps = real(model, prompt, tokens)
        return (out[:-1] + [(out[-1] + 1) % stack.vocab_size], gaps) if len(calls) == 3 else (out, gaps)

    monkeypatch.setattr(path_choice, "generate_reference", wrong_third)
    assert "row 2" in path_choice.check_rows(stack, graphs, LayerSkip(1, 2))


def test_the_compiled_batch_runner_keeps_the_graphs_it_made():
    """compile=on off CUDA: a batch's steps compiled per (B, width) once, before decoding; the decode makes no new
    graph, declines no call, and counts each graph once. Mutant caught: CompiledRunner.run_rows not recording what it
    made (every step then declined, frozen, to the eager steps)."""
    model, tok = tiny_model()
    stack = LayerStack(model)
    counter = CompileCounterWithBackend("eager")
    method = LayerSkip(1, 2)
    graphs, info = path_choice.make_graphs(stack, "on", method, 12, 64, backend=counter, batch=4)
    made, frames = graphs.graphs, counter.frame_count
    assert info["compiled"] and made > 0 and graphs.frozen
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    batch = Batch(stack, 4, Sampling(), set(), cache_len=63, path=LayerPath(stack, graphs))
    out = {}

    def decode(slot, i):
        out[i] = (yield Request(prompts[i], copy.deepcopy(method), 12, seed=i)).output_ids

    batch.run(range(4), decode)
    assert graphs.graphs == made and counter.frame_count == frames and not graphs.declined
    assert [out[i] for i in range(4)] == [hf_greedy(model, p, 12) for p in prompts[:4]]
