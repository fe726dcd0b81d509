"""engine/compiled.py: static-shape draft and verify steps that compile whole (fullgraph=True), one graph per step
shape for every position, giving the eager path's greedy tokens in float64.

Most tests capture with dynamo alone (fullgraph=True raises at any graph break; each new graph is counted); one
compiles with inductor (C++ codegen on CPU), the backend the engine uses; LS rounds through inductor are `slow`."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from del_bench import runner
from del_bench.config import ConfigError, validate
from del_bench.engine import compiled
from del_bench.engine.compiled import Compiled, bucket_of, static_mask
from del_bench.engine.decode import Engine
from del_bench.engine.sampling import Sampling
from del_bench.methods.ls import LayerSkip
from del_bench.methods.vanilla import Vanilla
from del_bench.models.layer_stack import LayerStack
from tests.conftest import tiny_model

# dynamo's whole-graph capture, run as captured: graph breaks and recompiles show here as under inductor, in a fraction
# of the time (inductor's own lowering and AOT's functionalisation of the cache writes: the inductor test below)
BACKEND = "eager"
PROMPT = "def add(a, b):\n"
TOKENS = 24


@pytest.fixture(scope="module")
def stack_and_prompt():
    model, tok = tiny_model()
    return LayerStack(model), tok(PROMPT)["input_ids"]


def eager_tokens(stack, prompt, method) -> list[int]:
    """The engine on the stack's own loop (tests/test_engine.py holds it equal to HF generate)."""
    return Engine(stack, Sampling(), set()).generate(prompt, method, TOKENS, seed=0).output_ids


def prefilled(stack, prompt) -> tuple[object, int]:
    """A cache holding the prompt (the eager prefill) and the first greedy token; NaN in every slot after it, as
    torch.empty may leave them (the steps must not let a masked slot's garbage through)."""
    cache = stack.new_cache(64)
    for k, v in zip(cache.k, cache.v):
        k.fill_(float("nan"))
        v.fill_(float("nan"))
    h = stack.forward_layers(stack.embed(torch.tensor([prompt])), 0, stack.num_layers, 0, cache)  # [1, P, D]
    return cache, int(stack.logits(h[:, -1:])[0, -1].argmax())


@torch.inference_mode()
def vanilla_with_steps(steps: Compiled, stack, prompt) -> list[int]:
    """Vanilla from the draft step at E = L (the final norm and head): one graph for every position."""
    cache, first = prefilled(stack, prompt)
    out = [first]
    while len(out) < TOKENS:
        pos = torch.tensor([len(prompt) + len(out) - 1])  # the pending token's position, a tensor
        _, _, token = steps.draft(torch.tensor([[out[-1]]]), pos, stack.num_layers, cache)
        out.append(int(token))
    return out


@torch.inference_mode()
def ls_with_steps(steps: Compiled, stack, prompt, exit_layer: int, gamma: int) -> list[int]:
    """LS(E, γ) rounds from the steps: d + 1 draft steps (the pending token and each draft through layers 1..E; the
    last one's head is unused), one verify step over their layer-E states, the longest agreeing prefix and the
    verifier's next token. No crop: a rejected position's slots are overwritten before any query's mask reaches them."""
    cache, first = prefilled(stack, prompt)
    out = [first]
    while len(out) < TOKENS:
        n = len(prompt) + len(out)
        d = min(gamma, TOKENS - len(out) - 1)
        token, states, drafts = torch.tensor([[out[-1]]]), [], []
        for j in range(d + 1):
            h, _, greedy = steps.draft(token, torch.tensor([n - 1 + j]), exit_layer, cache)
            states.append(h)
            drafts.append(int(greedy))
            token = greedy[None]
        _, targets = steps.verify(torch.cat(states, dim=1), torch.arange(n - 1, n + d), exit_layer, cache)
        targets = targets.tolist()  # [d + 1]
        k = next((i for i in range(d) if drafts[i] != targets[i]), d)
        out += drafts[:k] + [targets[k]]
    return out


def test_bucket_and_mask():
    assert [bucket_of(t) for t in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]
    mask = static_mask(torch.tensor([2, 3]), 5)
    assert mask.tolist() == [[True, True, True, False, False], [True, True, True, True, False]]


def test_steps_trace_whole_once_per_shape_and_give_eager_tokens(stack_and_prompt):
    """fullgraph=True (a graph break raises), and each step shape compiles once for every position and every padded
    width of its bucket: Vanilla's one draft graph; LS's draft graph and a verify graph per bucket it reached."""
    stack, prompt = stack_and_prompt
    counter = CompileCounterWithBackend(BACKEND)
    steps = Compiled(stack, backend=counter)
    assert vanilla_with_steps(steps, stack, prompt) == eager_tokens(stack, prompt, Vanilla())
    assert counter.frame_count == 1
    assert ls_with_steps(steps, stack, prompt, 1, 5) == eager_tokens(stack, prompt, LayerSkip(1, 5))
    verify_graphs = {key for key in steps._seen if key[0] == "verify"}
    assert len(verify_graphs) >= 2  # several widths, padded (d + 1 = 6 → 8, 3 → 4): the test's reach
    assert counter.frame_count == 2 + len(verify_graphs)  # no graph per position or per width within a bucket


@torch.inference_mode()
def test_a_padded_verify_gives_the_eager_rows_and_cache(stack_and_prompt):
    """Three positions through layers E+1..L, padded to a bucket of 4: the three rows' logits and every late layer's
    keys and values at their slots are the eager loop's (float64, up to summation order); the padded row writes only
    past them."""
    stack, prompt = stack_and_prompt
    E, L, P, T = 2, stack.num_layers, len(prompt), 3
    steps = Compiled(stack, backend=CompileCounterWithBackend(BACKEND))
    (eager, _), (static, _) = prefilled(stack, prompt), prefilled(stack, prompt)
    ids = torch.tensor([[7, 11, 13]])
    states = stack.forward_layers(stack.embed(ids), 0, E, P, eager)  # [1, T, D] layer-E states
    stack.forward_layers(stack.embed(ids), 0, E, P, static)
    expected = stack.logits(stack.forward_layers(states, E, L, P, eager))[0]  # [T, V]
    logits, tokens = steps.verify(states, torch.arange(P, P + T), E, static)
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-12)
    assert tokens.tolist() == expected.argmax(-1).tolist()
    for i in range(E, L):
        torch.testing.assert_close(static.k[i][:, :, : P + T], eager.k[i][:, :, : P + T], rtol=0, atol=1e-12)
        torch.testing.assert_close(static.v[i][:, :, : P + T], eager.v[i][:, :, : P + T], rtol=0, atol=1e-12)


def test_inductor_step_gives_eager_tokens(stack_and_prompt):
    """The backend the engine uses: inductor's C++ kernels. One graph (Vanilla's step: every layer, the cache writes,
    the masked SDPA, the head) keeps the compile to seconds once inductor's on-disk cache is warm."""
    stack, prompt = stack_and_prompt
    steps = Compiled(stack)
    assert vanilla_with_steps(steps, stack, prompt) == eager_tokens(stack, prompt, Vanilla())
    assert len(steps._seen) == 1 and steps.compile_s > 0


@pytest.mark.slow
def test_inductor_ls_rounds_give_eager_tokens(stack_and_prompt):
    """LS rounds (draft and padded verify graphs) through inductor: `pytest -m slow` (a minute or more of C++)."""
    stack, prompt = stack_and_prompt
    steps = Compiled(stack)
    assert ls_with_steps(steps, stack, prompt, 2, 2) == eager_tokens(stack, prompt, LayerSkip(2, 2))


@pytest.mark.parametrize("method", [Vanilla(), LayerSkip(1, 2)], ids=lambda m: m.name + str(m.describe()))
def test_engine_with_compile_on_gives_eager_tokens(stack_and_prompt, method):
    """compile=on: the engine's chain calls run the prepared graphs (LayerStack.forward_layers), the rest (prefill)
    the stack's loop; the tokens are the eager engine's, the counted layers the rounds' own, and nothing compiles
    after prepare (frozen): a shape not prepared (Vanilla's graphs under LS) runs on the stack's loop."""
    stack, prompt = stack_and_prompt
    other = LayerSkip(2, 3)
    reference, other_reference = eager_tokens(stack, prompt, method), eager_tokens(stack, prompt, other)
    counter = CompileCounterWithBackend(BACKEND)
    try:
        info = compiled.choose(stack, "on", method, TOKENS, backend=counter)
        graphs = counter.frame_count
        assert info["compiled"] and stack.compiled is not None and info["graphs"] == graphs
        assert info["compile_s"] > 0
        with stack.counting() as work:
            gen = Engine(stack, Sampling(), set()).generate(prompt, method, TOKENS, seed=0)
        assert gen.output_ids == reference
        assert work.layers == sum(r.loaded_layers for r in gen.rounds)  # the graphs count their layers too
        if method.name == "vanilla":
            assert eager_tokens(stack, prompt, other) == other_reference
        assert counter.frame_count == graphs  # prepared before: no compile inside a timed decode
    finally:
        stack.compiled = None


def test_compile_off_and_unsupported(stack_and_prompt):
    stack, _ = stack_and_prompt
    assert compiled.choose(stack, "off", Vanilla(), TOKENS) == {"compile": "off", "compiled": False}
    assert stack.compiled is None
    with pytest.raises(ValueError, match="compile='sometimes'"):
        compiled.choose(stack, "sometimes", Vanilla(), TOKENS)
    assert compiled.unsupported(stack) is None
    half = LayerStack(tiny_model(torch.bfloat16)[0])  # its verification rows are decode steps' bits: not batchable
    with pytest.raises(compiled.CompileUnavailable, match="row by row"):
        compiled.choose(half, "on", Vanilla(), TOKENS)
    assert compiled.choose(half, "auto", Vanilla(), TOKENS)["reason"].startswith("half precision on CPU")
    assert half.compiled is None


def test_a_run_validates_and_records_its_compile_setting(run_cfg):
    """compile is validated before the model loads (a boolean, as YAML reads a bare off, is off or on), and the run's
    setup line says what was chosen: off by default, the samples decoded by the stack's loop alone."""
    with pytest.raises(ConfigError, match="compile='sometimes' is not a choice"):
        validate(run_cfg("method=vanilla", "compile=sometimes"))
    validate(run_cfg("method=vanilla", "compile=false"))  # a boolean: off
    summary = runner.run(run_cfg("method=vanilla", "limit=1", "max_new_tokens=4", "layers=eager"))
    (setup,) = summary["setup"]
    assert setup["compile"] == "off" and setup["compiled"] is False
    assert summary["provenance"]["layer_path"] == "eager"


@pytest.mark.slow
def test_a_run_with_compile_on_decodes_on_the_steps_and_says_so(run_cfg):
    """compile=on through the runner (inductor): the graphs compile before the timed samples (compile_s in the setup
    line), the records say `eager+compiled` and so the run never pairs with an eager one (RunKey.machine)."""
    cfg = run_cfg("method=ls", "method.exit_layer=2", "method.gamma=2", "limit=1", "max_new_tokens=8", "layers=eager",
                  "compile=on")
    summary = runner.run(cfg)
    (setup,) = summary["setup"]
    assert setup["compiled"] is True and setup["compile_s"] > 0 and setup["graphs"] >= 3
    assert summary["provenance"]["layer_path"] == "eager+compiled"
    assert "eager+compiled layers" in summary["run_key"]["machine"]
