"""models/synthetic_segments.py: a synthetic model whose early exit agrees with the last layer at two levels by
context (`model.agreement_profile=segments`) — measurably more in high-kind contexts than in low-kind ones, also on
prompts it was not calibrated on; every method lossless on it; cached; the uniform profile's key and weights as
before; bad settings refused before any model loads."""

from __future__ import annotations

import copy

import pytest
import torch
from omegaconf import OmegaConf

from del_bench.config import validate
from del_bench.engine.decode import Engine
from del_bench.engine.sampling import Sampling
from del_bench.errors import ConfigError
from del_bench.methods.dynamic_exit import DEL
from del_bench.methods.ls import LayerSkip
from del_bench.models import synthetic
from del_bench.models import synthetic_segments as segments
from del_bench.models.layer_stack import LayerStack
from del_bench.models.loading import AnyIdTokenizer
from tests.conftest import compose_run
from tests.test_families import hf_greedy
from tests.test_synthetic import SMALL, prompts

E = SMALL["default_exit_layer"]
SEGMENTS = dict(SMALL, agreement_profile="segments", agreement_high=0.95, agreement_low=0.3, segment_tokens=8,
                mode_neurons=16)


def build(cache, **changes):
    return synthetic.build(OmegaConf.create({**SEGMENTS, **changes}), torch.float64, AnyIdTokenizer(), cache)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build(tmp_path_factory.mktemp("cache"))


def by_kind(model, ids: torch.Tensor, tokens: int) -> tuple[dict, dict]:
    """The exit's agreement at E by kind along the model's greedy continuations of `ids`, and the positions."""
    matches, inputs = synthetic.exit_matches(model, ids, tokens)
    sign = segments.draw(model, E, SEGMENTS["mode_neurons"], SEGMENTS["seed"]).sign
    agreement, positions = segments.agreement_by_kind(matches, inputs, sign)
    return {kind: a[E - 1] for kind, a in agreement.items()}, positions


def test_the_exit_agrees_by_context(model):
    """Calibrated: the exit agrees far more at high-kind positions than at low-kind ones, each near its target,
    both kinds met often, segments several tokens long, the last layer agreeing with itself."""
    syn = model.synthetic
    high, low = syn["agreement_by_kind"]["high"], syn["agreement_by_kind"]["low"]
    assert high >= 0.8 and low <= 0.5 and high - low >= 0.4, syn
    assert min(syn["positions_by_kind"].values()) >= 40, syn
    assert all(length >= 3 for length in syn["segment_tokens_by_kind"].values()), syn
    assert syn["agreement_by_layer_by_kind"]["low"][-1] == 1.0 and syn["profile"] == "segments"


def test_the_agreement_follows_the_context_on_other_prompts(model):
    """On prompts calibration never saw (other draws, other length), the exit agrees more in high-kind contexts than
    in low-kind ones by a wide margin. Mutants caught: the gates dropped (no kind writes: the kinds agree alike),
    the gates' sign flipped (the kinds swap)."""
    ids = torch.tensor([p[:12] for p in prompts(8, seed=11)])
    agreement, positions = by_kind(model, ids, 32)
    assert min(positions.values()) >= 40, positions
    assert agreement["high"] - agreement["low"] >= 0.35, agreement


@pytest.mark.parametrize("method", [LayerSkip(E, 3), DEL()], ids=lambda m: m.name)
def test_methods_are_lossless_on_the_segments_model(model, method):
    """float64: LS's and DEL's greedy outputs are generate's, token for token, on the segments model."""
    stack = LayerStack(model)
    for prompt in prompts(2, seed=5):
        ours = Engine(stack, Sampling(), set()).generate(prompt, copy.deepcopy(method), 24, seed=0).output_ids
        assert ours == hf_greedy(model, prompt, 24)


def test_the_constants_are_cached_and_the_weights_follow_them(tmp_path, monkeypatch):
    """A second build takes every constant from the cache (no calibration) and gives the same weights."""
    first = build(tmp_path, calibration_prompts=4, calibration_tokens=12)
    monkeypatch.setattr(synthetic, "calibrate_segments", lambda *a: pytest.fail("calibrated again"))
    again = build(tmp_path, calibration_prompts=4, calibration_tokens=12)
    assert all(torch.equal(a, b) for a, b in zip(first.parameters(), again.parameters()))
    assert {k: v for k, v in again.synthetic.items() if not k.endswith("_s")} == \
        {k: v for k, v in first.synthetic.items() if not k.endswith("_s")}


def test_the_uniform_profile_is_as_before(tmp_path):
    """The default profile: the cache key it always had, and the weights random_llama scaled by that r — nothing of
    the segments' mechanism in them; its configs' weights names unchanged, the segments' apart."""
    model = synthetic.build(OmegaConf.create(SMALL), torch.float64, AnyIdTokenizer(), tmp_path)
    shape = synthetic.shape_of(OmegaConf.create(SMALL))
    key = (f"testbed:{shape}:seed0:E{E}:{SMALL['agreement']}:torch.float64:cpu:"
           f"torch.Size([{SMALL['calibration_prompts']}, 16]):{SMALL['calibration_tokens']}")
    ratio = synthetic._cached(tmp_path, key)
    assert ratio == model.synthetic["ratio"] and "profile" not in model.synthetic
    plain = synthetic.random_llama(synthetic.llama_config(shape, eos_token_id=None), torch.float64, "cpu", 0)
    synthetic.scale_residual_writes(plain, ratio)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters()))
    assert compose_run("model=synthetic-smollm2").model.weights == "synthetic-smollm2-a0.8-E8-seed0-smollm2-135m"
    segmented = compose_run("model=synthetic-smollm2", "model.agreement_profile=segments").model.weights
    assert segmented == "synthetic-smollm2-a0.8-E8-seed0-smollm2-135m-segments-h0.95-l0.3-T32-k16"


@pytest.mark.parametrize("overrides, words", [
    (["model.agreement_profile=segmented"], "segments"),
    (["model.agreement_profile=segments", "model.agreement_low=1.2"], "agreement_low"),
    (["model.agreement_profile=segments", "model.agreement_high=0.2"], "must be below model.agreement_high=0.2"),
    (["model.agreement_profile=segments", "model.mode_neurons=5000"], "at most the MLP's width \\(1536\\)"),
    (["model.agreement_profile=segments", "model.segment_tokens=1"], "segment_tokens"),
])
def test_bad_profile_settings_are_refused_before_a_model_loads(overrides, words):
    """A misspelt profile (with the choices named), a level out of (0, 1) or not below the other, more neurons than
    the MLP has, a segment under 2 tokens: one ConfigError from validation, which loads nothing."""
    with pytest.raises(ConfigError, match=words):
        validate(compose_run("model=synthetic-smollm2", *overrides))


def test_the_segments_settings_validate():
    validate(compose_run("model=synthetic-smollm2", "model.agreement_profile=segments"))
