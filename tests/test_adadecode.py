"""AdaDecode's layer-parallel step: greedy outputs equal Vanilla's (own head and adapters, budgets ending inside
deferred work, EOS and stop conditions inside it), a rejection deep inside a run of early tokens rolls every layer's
cache back, accounting is exact. Sampling: tests/test_sampling_exact.py, tests/test_sampling_stats.py."""

from __future__ import annotations

import pytest
import torch

from del_bench.engine.decode import Engine
from del_bench.engine.sampling import Sampling
from del_bench.methods.adadecode import AdaDecode
from del_bench.methods.vanilla import Vanilla
from del_bench.models.layer_stack import LayerStack
from tests.conftest import tiny_model
from tests.test_engine import PROMPTS, hf_greedy
from tests.test_exit_adapters import random_adapters

L = 4
METHODS = [AdaDecode(), AdaDecode(gamma=0.0), AdaDecode(gamma=0.0, head_layers=[1]),
           AdaDecode(gamma=0.05, head_layers=[1, 2, 3]), AdaDecode(gamma=0.0, head_layers=[2, 3], max_outstanding=2),
           AdaDecode(gamma=0.02, head_layers=[1, 3], max_outstanding=1)]


@pytest.fixture(scope="module", params=["own-head", "adapters"])
def setup(request):
    model, tok = tiny_model()
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    refs = [hf_greedy(model, p, 40) for p in prompts]
    stack = LayerStack(model)
    if request.param == "adapters":
        stack.set_adapters(random_adapters(stack.norm_weight.shape[0]))
    return stack, prompts, refs


@pytest.mark.parametrize("method", METHODS, ids=lambda m: str(m.describe()))
def test_greedy_equals_vanilla(setup, method):
    stack, prompts, refs = setup
    engine = Engine(stack, Sampling(), eos_ids=set())
    for prompt, ref in zip(prompts, refs):
        for budget in (1, 2, 7, 40):  # budgets that end while early predictions are outstanding
            gen = engine.generate(prompt, method, budget, seed=0)
            assert gen.output_ids == ref[:budget]
            assert sum(r.emitted for r in gen.rounds) == len(gen.output_ids)


def test_early_exits_rejections_and_deep_rollbacks_really_happen(setup):
    stack, prompts, _ = setup
    gen = Engine(stack, Sampling(), set()).generate(prompts[0], AdaDecode(gamma=0.0, head_layers=[1]), 40, seed=0)
    verified = [v for r in gen.rounds for v in r.trace.get("verified", [])]
    assert any(v[2] for v in verified) and any(not v[2] for v in verified)
    # a rejection after at least one kept early token of the same batch: rollback from inside the run
    assert any(any(v[2] for v in r.trace["verified"]) and not r.trace["verified"][-1][2]
               for r in gen.rounds if r.trace.get("verified"))
    assert any(r.trace.get("dropped", 0) > 0 for r in gen.rounds)
    assert max(r.trace.get("outstanding", 0) for r in gen.rounds) == 5  # the cap


@pytest.mark.parametrize("eos_at", [3, 5, 9])
def test_eos_and_stop_inside_deferred_work(setup, eos_at):
    stack, prompts, refs = setup
    ref = refs[0]
    eos = ref[eos_at]
    for method in METHODS:
        gen = Engine(stack, Sampling(), eos_ids={eos}).generate(prompts[0], method, 40, seed=0)
        assert gen.output_ids == ref[: ref.index(eos) + 1]
        gen = Engine(stack, Sampling(), set(), stop=lambda ids: ids[-1] == eos).generate(prompts[0], method, 40, 0)
        assert gen.output_ids == ref[: ref.index(eos) + 1]


def test_a_deep_rejection_rolls_every_layers_cache_back(setup):
    """After generation (with early exits, rejections and dropped tokens) every layer's KV for every kept
    position equals a fresh full-depth pass over the final text: nothing of a dropped token survives."""
    stack, prompts, refs = setup
    engine = Engine(stack, Sampling(), set())
    method = AdaDecode(gamma=0.0, head_layers=[1, 2])
    gen = engine.generate(prompts[1], method, 33, seed=0)
    assert gen.output_ids == refs[1][:33]
    assert sum(r.trace.get("dropped", 0) for r in gen.rounds) > 0
    n = len(prompts[1]) + len(gen.output_ids) - 1  # the last token is pending: in no cache
    cache = engine.cache
    assert cache.lengths == [n] * L
    fresh = stack.new_cache(n + 1)
    stack.forward_layers(stack.embed(torch.tensor([prompts[1] + gen.output_ids[:-1]])), 0, L, 0, fresh)
    for i in range(L):
        assert torch.allclose(cache.k[i][:, :, :n], fresh.k[i][:, :, :n], atol=1e-10)
        assert torch.allclose(cache.v[i][:, :, :n], fresh.v[i][:, :, :n], atol=1e-10)


def test_accounting(setup):
    stack, prompts, _ = setup
    engine = Engine(stack, Sampling(), set())
    never = engine.generate(prompts[0], AdaDecode(gamma=1.0), 20, seed=0)  # no head is ever that sure
    vanilla = engine.generate(prompts[0], Vanilla(), 20, seed=0)
    assert never.output_ids == vanilla.output_ids
    assert never.loaded_layers == vanilla.loaded_layers == 20 * L  # eTPL exactly 1/L, as Vanilla
    assert never.drafted == 0
    gen = engine.generate(prompts[0], AdaDecode(gamma=0.0, head_layers=[1]), 20, seed=0)
    # every step runs each layer at most once, whatever its batch; an early step runs only layer 1
    for r in gen.rounds[1:]:
        assert r.loaded_layers == 1 if r.drafted else 1 <= r.loaded_layers <= L  # a flush skips layers all did
        assert r.adapter_rows == (r.drafted if stack.adapters is not None else 0)
    assert gen.accepted <= gen.drafted
    assert all(r.head_calls >= 1 for r in gen.rounds)


# sampling keeps the target distribution, deferred checks included: tests/test_sampling_exact.py and
# tests/test_sampling_stats.py


def test_validation():
    assert AdaDecode.problems({}, 4) == [] and AdaDecode.problems({"head_layers": [1, 3]}, 4) == []
    assert "method.gamma=1.5: must be a number in [0, 1]" in AdaDecode.problems({"gamma": 1.5}, 4)[0]
    assert "method.head_layers=[4]: must be a list of integers, each in [1, L − 1], here [1, 3]" in \
        AdaDecode.problems({"head_layers": [4]}, 4)[0]
    assert AdaDecode.default_layers(30) == [8, 15, 22] and AdaDecode.default_layers(32) == [8, 16, 24]
