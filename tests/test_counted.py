"""Counted, not claimed: every Round's loaded_layers, head_calls, shadow_rows and adapter_rows equal the work the
LayerStack really executed — counted where a decoder layer, a sublayer or an LM-head row runs (LayerStack.counting,
below the engine and apart from its bookkeeping) — round by round, for every method config, greedy and sampling,
with the own head and with exit adapters, on the eager and the fused layer loop.

A round's counted work is what ran between its Round's append and the previous one's; what runs after the last
append (DEL's deferred shadow scoring at the end of a generation) belongs to the last round, as the engine books it."""

from __future__ import annotations

import pytest
import torch
from hydra.utils import instantiate

from del_bench import runner, session
from del_bench.config import CONFIG_DIR
from del_bench.engine import row
from del_bench.engine.decode import Engine
from del_bench.engine.path_choice import stack_of
from del_bench.engine.rounds import Generation
from del_bench.engine.sampling import Sampling
from del_bench.models.kv_cache import WorkCounter
from del_bench.models.layer_stack import LayerStack
from tests.conftest import compose_run, tiny_model
from tests.test_engine import PROMPTS
from tests.test_exit_adapters import random_adapters

L = 4
CONFIGS = sorted(p.stem for p in (CONFIG_DIR / "method").glob("*.yaml"))
# overrides that reach what a config's defaults miss on a 4-layer random model in a few dozen tokens
SEARCH = ["method.context_window=4", "method.bayes_interval=0", "method.confidence=0.0", "method.d_max=5"]
VARIANTS = {
    "del_e_lim": [("", ["method.min_exit_layer=2"])],  # the config's 4 needs L > 4; at 3 no draft pays here
    "swift": [("", []),  # its optimiser's first probe comes after 33 tokens
              ("search", SEARCH),  # a probe every few rounds (random search: the probe is the same either way)
              ("tree", ["method.skip_set={attn:[1],mlp:[2]}", "method.tree=true"]),
              ("tree-search", [*SEARCH, "method.scope=prompt", "method.tree=true", "method.tree_widths=[2,4]",
                               "method.tree_confidences=[0.3]"])],
    "adadecode": [("", []), ("eager-exits", ["method.gamma=0.02", "method.max_outstanding=2"])],
    # selections from the first rounds on, every few rounds (their defaults: M = 8 > L; rounds 1-6 full-model drafts)
    "clasp": [("", ["method.skip_layers=2", "method.interval=3", "method.confidence=0.0"])],
    "knapspec": [("", ["method.warmup_rounds=2", "method.window_rounds=1", "method.interval=3",
                       "method.confidence=0.0", "method.prune=0.0"])],
}
CASES = [(name, tag, overrides) for name in CONFIGS for tag, overrides in VARIANTS.get(name, [("", [])])]
# the exit heads' paths (adapters change which rows run through a d×d map) and the fused loop's (every kind of
# forward_layers call: prefill, drafts, verification, single layers, a token tree; SWIFT's sublayers stay eager)
ADAPTER_CASES = [c for c in CASES if c[0] in ("ls", "dv", "del", "del_cpu") or c[1] == "eager-exits"]
FUSED_CASES = [c for c in CASES if c[0] in ("vanilla", "ls", "del", "clasp") or c[1] in ("eager-exits", "tree-search")]
SAMPLING = {"greedy": Sampling(), "sampling": Sampling(do_sample=True, temperature=1.2, top_p=0.95)}
TOKENS = 30


def case_id(case) -> str:
    name, tag, _ = case
    return f"{name}-{tag}" if tag else name


def method_of(name: str, overrides: list[str]):
    method = instantiate(compose_run("model=tiny-random", f"method={name}", *overrides).method)
    method.validate(L)
    if method.wants_costs:  # del_cpu, knapspec: fixed costs (a head row = 0.2 layers), no decision on a clock
        method.set_costs(layer_s=1.0, head_s=0.2, batch_s=[[1, 4.0], [2, 4.4], [4, 5.2], [8, 6.8]],
                         sublayer_s=[[8, 1.1, 1.0], [64, 1.6, 1.0]])
    return method


class _Marked(list):
    """Generation.rounds that notes the stack's counter at every append."""

    def __init__(self, counter: WorkCounter):
        super().__init__()
        self.counter = counter
        self.marks: list[tuple] = []

    def append(self, r) -> None:
        self.marks.append(_totals(self.counter))
        super().append(r)


def _totals(c: WorkCounter) -> tuple:
    return c.layers, c.head_rows, c.shadow_rows, c.adapter_rows


def counted_generate(engine: Engine, monkeypatch, prompt, method, seed: int) -> tuple[Generation, list, list]:
    """Generate while counting → (gen, per round claimed, per round counted), each (layers, head rows, shadow rows,
    adapter rows)."""
    with engine.stack.counting() as counter, monkeypatch.context() as patch:
        def marked(*args, **kwargs) -> Generation:
            gen = Generation(*args, **kwargs)
            gen.rounds = _Marked(counter)
            return gen

        patch.setattr(row, "Generation", marked)
        gen = engine.generate(prompt, method, TOKENS, seed=seed)
        marks = [(0, 0, 0, 0), *gen.rounds.marks, _totals(counter)]
    counted = [tuple(b - a for a, b in zip(before, after)) for before, after in zip(marks, marks[1:])]
    tail = counted.pop()  # after the last append: the last round's
    counted[-1] = tuple(a + b for a, b in zip(counted[-1], tail))
    claimed = [(r.loaded_layers, r.head_calls, r.shadow_rows, r.adapter_rows) for r in gen.rounds]
    return gen, claimed, counted


@pytest.fixture(scope="module")
def prompts():
    tok = tiny_model()[1]
    return [tok(p)["input_ids"] for p in PROMPTS[:2]]


@pytest.fixture(scope="module")
def eager():
    return LayerStack(tiny_model()[0])


@pytest.fixture(scope="module")
def adapted():
    stack = LayerStack(tiny_model()[0])
    stack.set_adapters(random_adapters(stack.norm_weight.shape[0]))
    return stack


def test_the_counter_counts_in_the_papers_units(eager):
    """A layer over T positions is one load, a sublayer half of one; a head row is a position through the head;
    shadow rows are apart from head rows; nothing is counted outside `counting`."""
    st, D = eager, eager.norm_weight.shape[0]
    cache = st.new_cache(16)
    with st.counting() as c:
        h = st.forward_layers(st.embed(torch.tensor([[5, 6, 7]])), 0, L, 0, cache)  # [1, 3, D]
        assert (c.layers, c.head_rows) == (L, 0)
        st.forward_skipping(st.embed(torch.tensor([[8]])), 3, cache, frozenset({1}), frozenset({1, 2}))
        assert c.layers == L + L - 1.5
        st.logits(h)
        st.exit_logits(h[:, -1:], 2)
        assert c.head_rows == 4 and c.adapter_rows == 0
        st.shadow_tokens(torch.randn(6, D, dtype=st.dtype))
        st.shadow_tokens(torch.randn(6, D, dtype=st.dtype), torch.arange(6), vocab=50)
        assert (c.shadow_rows, c.head_rows) == (12, 4)
    assert st.counter is None
    st.forward_layers(st.embed(torch.tensor([[9]])), 0, L, 3, cache)
    assert c.layers == 2 * L - 1.5


def check_rounds(stack, monkeypatch, prompts, case, sampling) -> list:
    """Every round of every prompt: claimed == counted. Returns all rounds (for the reach checks)."""
    method = method_of(case[0], case[2])
    engine = Engine(stack, sampling, eos_ids=set())
    rounds = []
    for seed, prompt in enumerate(prompts):
        gen, claimed, counted = counted_generate(engine, monkeypatch, prompt, method, seed)
        assert counted == claimed, [(i, c, k) for i, (c, k) in enumerate(zip(claimed, counted)) if c != k]
        rounds += gen.rounds
    return rounds


@pytest.mark.parametrize("decoding", SAMPLING)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_rounds_claim_what_the_stack_ran(eager, prompts, monkeypatch, case, decoding):
    rounds = check_rounds(eager, monkeypatch, prompts, case, SAMPLING[decoding])
    name, tag, _ = case
    # not vacuous: the paths each case is here for were taken
    if name != "vanilla" and (name, tag) != ("adadecode", ""):  # its γ = 0.75 is above every head's top p here
        assert any(r.drafted for r in rounds)
    assert any(r.shadow_rows for r in rounds) == name.startswith("del")
    assert any("opt_kind" in r.trace for r in rounds) == ("search" in tag)
    assert any(r.trace.get("tree_siblings") for r in rounds) == ("tree" in tag)
    assert any("sel_loaded_layers" in r.trace for r in rounds) == (name in ("clasp", "knapspec"))  # selections ran


@pytest.mark.parametrize("case", ADAPTER_CASES, ids=case_id)
def test_rounds_claim_what_ran_with_exit_adapters(adapted, prompts, monkeypatch, case):
    rounds = check_rounds(adapted, monkeypatch, prompts, case, SAMPLING["sampling"])
    assert any(r.adapter_rows for r in rounds)  # drafts through the adapters happened


@pytest.fixture(scope="module")
def fused_stack():
    return stack_of(tiny_model()[0], layers="fused")


@pytest.mark.parametrize("case", FUSED_CASES, ids=case_id)
def test_rounds_claim_what_the_fused_loop_ran(fused_stack, prompts, monkeypatch, case):
    assert fused_stack.layer_path == "fused"
    check_rounds(fused_stack, monkeypatch, prompts, case, SAMPLING["greedy"])


def test_the_counter_is_off_outside_counting(run_cfg):
    """Normal runs count nothing: the stack has no counter before, during (nothing opens one) or after a run."""
    stacks = []

    def load():
        loaded, stack = session.load_model(run_cfg().model, "eager")
        assert stack.counter is None
        stack.counting = None  # anything that tried to count would fail here
        stacks.append(stack)
        return loaded, stack

    runner.run(run_cfg("method=del", "limit=1", "max_new_tokens=4"), load=load)
    assert stacks and stacks[0].counter is None
