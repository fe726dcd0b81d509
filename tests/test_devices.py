"""One device story: under a device_map each layer runs where its weights live (its KV cache beside it), token ids
start on the embedding's device, and everything after the layers — norm, exit adapters, head, shadow states and
their scoring, the sampling RNG — happens on the head's device; offloaded or meta weights are refused up front.

Two GPUs are not at hand: a stack whose last layers, norm and head sit on 'meta' stands in for one split across two
devices — torch refuses to mix cpu and meta tensors in one op exactly as it refuses two GPUs', so every state
collected, concatenated or scored on the wrong device fails here. Meta holds no values, so these tests run the
pieces (forward passes, the shadow window, shadow scoring, placement), not whole generations; where a GPU is
present, the last test decodes with layers split across cpu and cuda."""

from __future__ import annotations

import pytest
import torch

from del_bench.engine.decode import Draft, Engine, Verified
from del_bench.engine.sampling import Sampling
from del_bench.engine.shadow import ShadowScorer
from del_bench.errors import ConfigError
from del_bench.methods.adadecode import AdaDecode
from del_bench.methods.swift import Swift
from del_bench.models import layer_stack
from del_bench.models.exit_adapters import ExitAdapters
from del_bench.models.layer_math import cat_on
from del_bench.models.layer_stack import LayerStack
from del_bench.models.loading import check_resident
from tests.conftest import tiny_model
from tests.test_engine import METHODS, PROMPTS

CPU, META = torch.device("cpu"), torch.device("meta")
SPLIT = 2  # layers 0..1 on the first device, 2..3 (and norm, head) on the second


@pytest.fixture
def split(monkeypatch) -> LayerStack:
    """A tiny eager stack whose layers SPLIT.., final norm and LM head are on 'meta' (as device_map puts a model's
    tail beside its head); LayerStack's refusal of meta weights is lifted for it."""
    model, _ = tiny_model()
    for module in (*model.model.layers[SPLIT:], model.model.norm, model.lm_head):
        module.to(META)
    monkeypatch.setattr(layer_stack, "check_resident", lambda model: None)
    return LayerStack(model)


def test_meta_or_offloaded_weights_are_refused_naming_the_modules():
    model, _ = tiny_model()
    model.model.layers[2].to(META)  # what accelerate's cpu/disk offload leaves in the module
    with pytest.raises(ConfigError, match=r"meta device: model\.layers\.2\)") as err:
        LayerStack(model)
    assert "model.layers.1" not in str(err.value) and "model.layers.3" not in str(err.value)

    model, _ = tiny_model()
    model.hf_device_map = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": "cpu",
                           "model.layers.2": 1, "model.layers.3": 1, "model.norm": 1, "lm_head": "disk"}
    with pytest.raises(ConfigError, match=r"offloaded by device_map to cpu/disk: model\.layers\.1, lm_head\)"):
        check_resident(model)
    model.hf_device_map = {"model.layers.0": 0, "model.layers.1": "cpu"}  # cpu beside a GPU: accelerate offloads it
    with pytest.raises(ConfigError, match=r"cpu/disk: model\.layers\.1\)"):
        check_resident(model)
    for placed in ({"": "cpu"}, {"": 0}, {"model.layers.0": 0, "model.layers.1": 1}):  # wholly resident
        model.hf_device_map = placed
        check_resident(model)


def test_cat_on_gathers_states_of_two_devices_on_one():
    a, b = torch.ones(1, 2, 3), torch.zeros(1, 2, 3, device=META)
    with pytest.raises(RuntimeError, match="device"):
        torch.cat([a, b])  # the stand-in really is a second device
    assert cat_on([a, b], META).shape == (2, 2, 3) and cat_on([a, b], META).device == META
    assert cat_on([a, a], CPU, dim=1).equal(torch.ones(1, 4, 3))  # one device: the plain cat


def test_placement_follows_one_rule(split):
    assert split.devices == [CPU, META]
    cache = split.new_cache(16)
    assert [k.device for k in cache.k] == [CPU, CPU, META, META]  # each layer's KV beside its weights
    split.set_adapters(ExitAdapters.identity([1, 3], split.config.hidden_size))
    assert split.adapters.weight.device == META  # exit adapters beside the head
    engine = Engine(split, Sampling(do_sample=True), set())
    assert engine.rng_device == META and engine.ids([1, 2]).device == CPU  # RNG by the logits, ids by the embedding
    h = split.forward_layers(split.embed(engine.ids([1, 2, 3])), 0, 1, 0, cache)  # layer 1's state, on cpu
    assert split.exit_logits(h, 1).device == META


def test_prefill_keeps_each_layers_window_and_gathers_it_on_the_heads_device(split):
    cache, kept = split.new_cache(16), []
    h = split.forward_layers(split.embed(torch.tensor([[1, 5, 9, 4, 7]])), 0, 4, 0, cache, collect=kept, keep=3)
    assert h.device == META and h.shape[1] == 5
    assert [(s.device, tuple(s.shape)) for s in kept] == [(CPU, (1, 3, 64))] * 2 + [(META, (1, 3, 64))] * 2
    shadow = ShadowScorer(split).prefill(kept, h, 3, None)  # layers 1..3's windows, scored beside the head
    assert shadow.states.shape == (3, 3, 64) and shadow.tokens.device == META
    # verification from an exit layer on the second device: its batch starts there, the RoPE tables on the first
    late = split.forward_layers(h[:, -2:], 2, 4, 5, cache)
    assert late.device == META and cache.lengths == [5, 5, 7, 7]
    assert split.forward_skipping(split.embed(torch.tensor([[3]])), 5, cache, frozenset({0}), frozenset({3})).device \
        == META  # SWIFT's draft model crosses the devices too


def test_shadow_window_and_its_scoring_happen_on_the_heads_device(split):
    """A DEL round with E = 1 (cpu): layer 1 from drafting (cpu), layers 2..3 from verification (cpu, meta), as the
    early-exit shape runs a lone row's passes (engine/early_exit.py)."""
    engine = Engine(split, Sampling(), set())
    cache = split.new_cache(16)
    split.forward_layers(split.embed(engine.ids([1, 5, 9])), 0, 4, 0, cache)
    draft = Draft(early=[], exit_layer=1, drafts=[8])
    for pos, token in enumerate([4, 8], start=3):  # the pending token and one draft through layer 1
        layers: list = []
        draft.exit_states.append(split.forward_layers(split.embed(engine.ids([token])), 0, 1, pos, cache, layers))
        draft.early.append(layers)
    late: list = []
    h = split.forward_layers(torch.cat(draft.exit_states, dim=1), 1, 4, 3, cache, collect=late)
    verified = Verified(split.norm(h), late, split.head)
    assert [s.device for s in verified.late] == [CPU, META, META]
    verified.rows = {0: 8, 1: 6}  # acceptance's rows (meta holds no logits to take an argmax of)
    scorer = ShadowScorer(split)
    states, target = scorer.window(draft, verified, 1, k=1)
    assert states.shape == (3, 2, 64) and states.device == META and target.device == META
    shadow = scorer.score(states, target, None)
    assert shadow.tokens.shape == (3, 2) and shadow.tokens.device == META


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here: no decode split across cpu and cuda")
def test_decoding_split_across_cpu_and_cuda():
    """Layers 0..1 on cpu, 2..3 with norm and head on cuda: every method's greedy output is Vanilla's on the same
    split (float64), and sampling runs (its RNG on the head's device)."""
    model, tok = tiny_model()
    for module in (*model.model.layers[SPLIT:], model.model.norm, model.lm_head):
        module.to("cuda")
    stack = LayerStack(model)
    assert [d.type for d in stack.devices] == ["cpu", "cuda"]
    methods = [*METHODS, AdaDecode(gamma=0.0, head_layers=[1, 3]), Swift(skip_set={"attn": [1], "mlp": [2]}),
               Swift(skip_set={"attn": [1, 2], "mlp": [1, 2]}, confidence=0.0, d_max=4, tree=True)]
    for prompt in (tok(p)["input_ids"] for p in PROMPTS[:2]):
        greedy, sampled = Engine(stack, Sampling(), set()), Engine(stack, Sampling(do_sample=True), set())
        reference = greedy.generate(prompt, methods[0], 24, seed=0).output_ids
        for method in methods:
            assert greedy.generate(prompt, method, 24, seed=0).output_ids == reference, method.name
            assert len(sampled.generate(prompt, method, 16, seed=1).output_ids) == 16
