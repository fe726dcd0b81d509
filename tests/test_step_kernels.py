"""What inductor is asked for and what it makes of the static steps (engine/static_steps.py), the latter read from
its post-grad graph: the FX graph after inductor's own passes (its reinplacing included), as it prints it for
TORCH_LOGS=post_grad_graphs. The compile is stopped there — no kernel is generated, so each check takes a second, and
none needs a GPU: the graphs a CUDA run compiles are these graphs (static shapes at the captured cache's lengths; the
CPU's compiled path marks the attended length dynamic)."""

from __future__ import annotations

import logging
import re

import pytest
import torch
from torch._inductor.compile_fx import compile_fx

from del_bench.engine import static_steps
from del_bench.engine.compiled import RECOMPILE_LIMIT, Graphs
from del_bench.engine.graph_runners import attended_views
from del_bench.engine.static_steps import CUDA_INDUCTOR_OPTIONS, StaticSteps, StepFunctions, adopt, inductor_options
from del_bench.models.layer_stack import LayerStack
from tests.conftest import tiny_model

POST_GRAD = "torch._inductor.compile_fx.__post_grad_graphs"  # the artifact logger of TORCH_LOGS=post_grad_graphs


class _Seen(Exception):
    """Raised once the post-grad graph is printed: the rest of the compile is not needed."""


class _PostGrad(logging.Handler):
    def __init__(self):
        super().__init__()
        self.text: str | None = None

    def emit(self, record):
        self.text = record.getMessage()
        raise _Seen


def post_grad_graph(fn, *args) -> str:
    """The post-grad graph inductor makes of fn(*args) (fn: torch.compile'd with inductor), its compile stopped once
    it is printed. The FX graph and AOT caches are off for the call (a cached graph skips the passes), and dynamo's
    recompile limit is the engine's (every test's step functions share one code object)."""
    logger, catch = logging.getLogger(POST_GRAD), _PostGrad()
    level = logger.level
    logger.addHandler(catch)
    logger.setLevel(logging.DEBUG)
    try:
        with torch._inductor.config.patch(fx_graph_cache=False), \
                torch._functorch.config.patch(enable_autograd_cache=False), \
                torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT), torch.inference_mode():
            fn(*args)
    except Exception:  # noqa: BLE001 — _Seen, wrapped by dynamo; anything else leaves no graph, asserted below
        pass
    finally:
        logger.removeHandler(catch)
        logger.setLevel(level)
    assert catch.text is not None, "inductor printed no post-grad graph"
    return catch.text


def inplace_on_inputs(graph: str) -> list[str]:
    """The in-place ops the graph applies to its inputs (placeholders argN_1), in order: what a step writes."""
    return [op for op, _ in re.findall(r"torch\.ops\.aten\.(\w+_)\.\w+\((arg\d+_1)\b", graph)]


@pytest.fixture(scope="module")
def stack():
    model, _ = tiny_model(torch.float32)
    return LayerStack(model)


def inductor(gm, example_inputs):
    """Inductor itself, under a backend object of this module's own: dynamo reuses no graph another test compiled."""
    return compile_fx(gm, example_inputs)


def layer_step(stack, dynamic: bool):
    """(a width-1 layer step compiled by inductor, its arguments): on a cache whose length is static (the CUDA graphs'
    path) or marked dynamic (the CPU's compiled path)."""
    fns = StepFunctions(StaticSteps(stack), inductor)
    cache = stack.new_cache(64)
    adopt(cache)
    (k,), (v,) = attended_views(cache, [0], 64, dynamic)
    h = torch.randn(1, 1, stack.embed_weight.shape[1])
    return fns.layer, (stack.layers[0], h, torch.tensor([[5]]), k, v)


def rows_step(stack, batch: int = 2):
    """A batch's width-1 layer step (rows_layer) at B rows, compiled by inductor, and its arguments."""
    fns = StepFunctions(StaticSteps(stack), inductor)
    cache = stack.new_cache(64, batch=batch)
    adopt(cache)
    h = torch.randn(batch, 1, stack.embed_weight.shape[1])
    live = torch.tensor([True, False][:batch])
    return fns.rows_layer, (stack.layers[0], h, torch.tensor([[5], [63]][:batch]), live, live, cache.k[0], cache.v[0])


@pytest.mark.parametrize("case", ["static", "dynamic", "rows"])
def test_a_compiled_step_writes_its_positions_not_a_copy_of_the_cache(stack, case):
    """The cache write of a compiled width-1 step stays in place: the post-grad graph writes the layer's keys and
    values with one index_put_ each and copies no cache back — the pattern scatter_ left (an out-of-place scatter
    into a copy of the whole layer's cache, then copy_ back: every slot of K and V twice a step), on the static-shape
    path CUDA graphs capture, the CPU's dynamic one, and a batch's."""
    fn, args = rows_step(stack) if case == "rows" else layer_step(stack, dynamic=case == "dynamic")
    graph = post_grad_graph(fn, *args)
    assert inplace_on_inputs(graph) == ["index_put_", "index_put_"]
    assert "aten.scatter" not in graph


def test_the_check_sees_a_scatter_write(stack, monkeypatch):
    """The check above is not vacuous: with the cache written by scatter_ it sees the copies back."""
    def scatter_write(cache, slots, new):
        cache.scatter_(2, slots[:, None, :, None].expand(-1, cache.shape[1], -1, cache.shape[3]), new)

    monkeypatch.setattr(static_steps, "write_slots", scatter_write)
    fn, args = layer_step(stack, dynamic=False)
    assert inplace_on_inputs(post_grad_graph(fn, *args)) == ["copy_", "copy_"]


def test_compiles_for_cuda_ask_inductor_for_tuned_kernels_and_the_setup_line_says_so(stack, monkeypatch):
    """For CUDA the step functions are compiled with gpt-fast's inductor settings (coordinate-descent tuning: a
    width-1 product becomes a tuned reduction fused with its neighbours; unique kernel names; the FX graph cache) —
    torch.compile takes them (it checks each name when called, no GPU needed) — and the graphs' setup line records
    them; on a CPU nothing is asked (the defaults: no slower compile) and the line says so."""
    calls, compile_ = [], torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: calls.append(kwargs) or compile_(fn, **kwargs))
    cuda = StepFunctions(StaticSteps(stack), "inductor", device_type="cuda")
    assert [call.get("options") for call in calls] == [CUDA_INDUCTOR_OPTIONS] * 4  # layer, attention, mlp, rows_layer
    assert CUDA_INDUCTOR_OPTIONS == {"coordinate_descent_tuning": True, "triton.unique_kernel_names": True,
                                     "fx_graph_cache": True}
    cpu = StepFunctions(StaticSteps(stack), "inductor")
    assert cpu.options == {} and all("options" not in call for call in calls[4:])
    assert inductor_options(inductor, "cuda") == {}  # another backend is not inductor's to configure
    graphs = Graphs(stack)  # compile=on on this CPU
    assert graphs.setup() == {"inductor_options": {}}
    graphs.functions = cuda
    assert graphs.setup() == {"inductor_options": CUDA_INDUCTOR_OPTIONS}
