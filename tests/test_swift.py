"""SWIFT: the sublayer-skipping draft step is lossless (greedy = HF generate in float64, sampling keeps the target
distribution), accounted at ½ layer per sublayer, its optimiser finds the redundant sublayers, and its config
errors surface before any weights load."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from del_bench import runner
from del_bench.engine.decode import Engine
from del_bench.engine.sampling import Sampling
from del_bench.errors import ConfigError
from del_bench.methods.base import Probe, SkipSet
from del_bench.methods.swift import Swift, compact, odd_layers, parse_skip_set, skip_count, skip_set_of
from del_bench.models.layer_stack import LayerStack
from tests.conftest import tiny_model
from tests.test_engine import L, assert_greedy_equals_reference, stack_and_ref  # noqa: F401 (fixtures)

METHODS = [
    Swift(skip_set={"attn": [1], "mlp": [2]}),
    Swift(skip_set={"attn": [1, 2], "mlp": [1, 2]}, confidence=0.0, d_max=50),  # budgets hit the token limit
    Swift(skip_set={"attn": [], "mlp": []}, confidence=0.0),  # the draft is the full model: all accepted
    Swift(context_window=4, bayes_interval=3, scope="prompt"),  # the optimiser on, restarted per prompt
    Swift(context_window=4, bayes_interval=2, encoding="threshold", opt_window="last", confidence=0.0, d_max=6),
    # the dynamic token tree: leaves beside every draft (random tiny models are unsure: ~10 candidates a depth)
    Swift(skip_set={"attn": [1], "mlp": [2]}, tree=True),
    Swift(skip_set={"attn": [1, 2], "mlp": [1, 2]}, confidence=0.0, d_max=50, tree=True),
    Swift(context_window=4, bayes_interval=3, scope="prompt", confidence=0.0, d_max=5, tree=True,
          tree_widths=[2, 4], tree_confidences=[0.3]),
]


def method_id(m: Swift) -> str:
    fixed = m.skip_set_arg is not None
    name = compact(parse_skip_set(m.skip_set_arg)) if fixed else f"search-{m.encoding}-{m.opt_window}"
    return name + ("-tree" if m.tree else "")


@pytest.mark.parametrize("method", METHODS, ids=method_id)
def test_greedy_equals_hf_generate(stack_and_ref, method):  # noqa: F811
    method.validate(L)
    assert_greedy_equals_reference(stack_and_ref, method)


def test_swift_speculates_and_its_optimiser_runs(stack_and_ref):  # noqa: F811
    """Guard against vacuous equality: drafts are accepted and rejected, and optimiser rounds happened."""
    stack, _, prompts, _ = stack_and_ref
    engine = Engine(stack, Sampling(), set())
    gen = engine.generate(prompts[0], Swift(skip_set={"attn": [1], "mlp": [2]}, confidence=0.0, d_max=4), 40, seed=0)
    assert 0 < gen.accepted < gen.drafted
    gen = engine.generate(prompts[0], Swift(context_window=4, bayes_interval=3), 40, seed=0)
    kinds = [r.trace["opt_kind"] for r in gen.rounds if "opt_kind" in r.trace]
    assert "random" in kinds and "bayes" in kinds


def test_the_tree_takes_leaves_and_keeps_the_cache_on_the_path(stack_and_ref):  # noqa: F811
    """Guard against a vacuous tree: some rounds end on a sibling (its KV moved onto the path), and the greedy
    output still equals the reference after them; a tree costs head rows, not loaded layers."""
    stack, _, prompts, refs = stack_and_ref
    engine = Engine(stack, Sampling(), set())
    method = Swift(skip_set={"attn": [1, 2], "mlp": [1, 2]}, confidence=0.0, d_max=3, tree=True)
    gen = engine.generate(prompts[0], method, 40, seed=0)
    trees = [r for r in gen.rounds[1:] if "tree_siblings" in r.trace]
    leaves = [r for r in trees if r.trace["tree_leaf_accepted"]]
    assert trees and leaves and gen.output_ids == refs[0][:40]
    assert all(r.loaded_layers == r.drafted * (L - 2) + L for r in gen.rounds[1:])
    assert all(r.accepted <= r.drafted for r in gen.rounds)
    chain = engine.generate(prompts[0], Swift(skip_set={"attn": [1, 2], "mlp": [1, 2]}, confidence=0.0, d_max=3),
                            40, seed=0)
    assert len(gen.rounds) < len(chain.rounds)  # leaves save rounds


def test_eos_inside_a_draft_ends_the_output_like_hf(stack_and_ref):  # noqa: F811
    stack, _, prompts, refs = stack_and_ref
    eos = refs[0][5]
    expected = refs[0][: refs[0].index(eos) + 1]
    engine = Engine(stack, Sampling(), eos_ids={eos})
    full = Swift(skip_set={"attn": [], "mlp": []}, confidence=0.0)  # drafts everything, EOS included
    gen = engine.generate(prompts[0], full, 40, seed=0)
    assert gen.output_ids == expected and gen.rounds[-1].drafted >= 1
    for method in METHODS:
        assert engine.generate(prompts[0], method, 40, seed=0).output_ids == expected


def test_accounting_counts_a_sublayer_as_half_a_layer(stack_and_ref):  # noqa: F811
    stack, _, prompts, _ = stack_and_ref
    engine = Engine(stack, Sampling(), set())
    skip = {"attn": [1, 2], "mlp": [2]}  # 3 sublayers: a draft token loads L − 1.5 layers
    gen = engine.generate(prompts[0], Swift(skip_set=skip, confidence=0.0, d_max=3), 30, seed=0)
    assert all(r.loaded_layers == r.drafted * (L - 1.5) + L for r in gen.rounds)
    assert any(isinstance(r.loaded_layers, float) for r in gen.rounds if r.drafted % 2)
    assert gen.head_calls == sum(2 * r.drafted + 1 for r in gen.rounds)  # none dropped; every verify row runs
    assert all(r.exit_layer is None for r in gen.rounds)  # no exit layer: full depth, sublayers skipped
    assert gen.rounds[1].trace["skip_set"] == "attn:1,2;mlp:2"
    assert all("skip_set" not in r.trace for r in gen.rounds[2:])  # named again only when it changes
    assert sum(r.emitted for r in gen.rounds) == len(gen.output_ids) == 30

    search = Swift(skip_ratio=0.5, context_window=4, bayes_interval=0)  # N = 2: a probe loads L − 1 layers
    gen = engine.generate(prompts[0], search, 30, seed=0)
    for r in gen.rounds[1:]:
        size = sum(len(part.split(":")[1].split(",")) for part in (r.trace.get("skip_set") or "a:;m:").split(";")
                   if part.split(":")[1])
        opt = r.trace.get("opt_loaded_layers", 0)
        assert opt in (0, L - 1) and r.trace.get("opt_head_calls", 0) == (4 if opt else 0)
        if "skip_set" in r.trace:
            current = size
        assert r.loaded_layers == pytest.approx(r.drafted * (L - current / 2) + L + opt)
    first = next(i for i, r in enumerate(gen.rounds) if "opt_kind" in r.trace)
    # the first probe comes once more than context_window + 1 tokens are out (the authors' test)
    assert sum(r.emitted for r in gen.rounds[:first]) > 5 >= sum(r.emitted for r in gen.rounds[: first - 1])
    assert all(0 <= r.trace["opt_s"] <= r.policy_s for r in gen.rounds if "opt_s" in r.trace)


# speculative sampling (chain and tree) keeps the target distribution: tests/test_sampling_exact.py and
# tests/test_sampling_stats.py


# ---- the optimiser ------------------------------------------------------------------------------------------------

REDUNDANT = {"attn": [2, 4, 6], "mlp": [3, 5, 6]}  # sublayers made near-identity below (8 layers, 12 slots)


def redundant_model():
    """8 random layers at full residual scale, six of whose sublayers write almost nothing: skipping those
    four of them leaves the model's argmax unchanged, skipping the others does not."""
    model, tok = tiny_model(num_layers=8, late_residual_scale=1.0, seed=1)
    with torch.no_grad():
        for i in REDUNDANT["attn"]:
            model.model.layers[i].self_attn.o_proj.weight.mul_(1e-4)
        for i in REDUNDANT["mlp"]:
            model.model.layers[i].mlp.down_proj.weight.mul_(1e-4)
    return model, tok


def test_the_optimiser_finds_the_near_identity_sublayers():
    model, tok = redundant_model()
    engine = Engine(LayerStack(model), Sampling(), set())
    method = Swift(skip_ratio=0.34, context_window=8, bayes_interval=5, patience=200, seed=0)  # N = 4 of 12
    assert skip_count(8, 0.34) == 4
    scores = []
    for text in ["def add(a, b):\n", "The quick brown fox", "import os\n", "x = 1\n", "for i in range(3):"]:
        gen = engine.generate(tok(text)["input_ids"], method, 60, seed=0)
        scores += [r.trace["opt_matchness"] for r in gen.rounds if "opt_matchness" in r.trace]
        if method.stopped:
            break
    assert method.stopped == "matchness" and method.best > 0.95
    assert set(method.current.attn) <= set(REDUNDANT["attn"]) and set(method.current.mlp) <= set(REDUNDANT["mlp"])
    assert method.current.size == 4
    assert scores[0] < method.best and max(scores) == method.best  # the search improved on its first candidate
    # the start set (odd layers, both sublayers) skips real computation: its drafts are worse
    start = Swift(skip_set=odd_layers(8).as_dict(), confidence=0.0, d_max=4)
    found = Swift(skip_set=method.current.as_dict(), confidence=0.0, d_max=4)
    prompt = tok("The quick brown fox")["input_ids"]
    a_start, a_found = (engine.generate(prompt, m, 40, seed=0) for m in (start, found))
    assert a_found.accepted / a_found.drafted > a_start.accepted / a_start.drafted


def feed(method: Swift, matchness, generated: int = 100) -> list[Probe]:
    """Run optimiser steps with scripted matchness values; returns the probes."""
    probes = []
    for m in matchness:
        probe = method.probe(generated)
        if probe is None:
            break
        probes.append(probe)
        method.scored(probe, m)
    return probes


def test_bayesian_suggestions_respect_the_skip_count_and_every_kth_step_is_one():
    method = Swift(skip_ratio=0.45, bayes_interval=5, seed=3)  # the paper's 25, shortened: a GP step costs ~1 s
    method.validate(30)
    method.start(30)
    n = skip_count(30, 0.45)  # int(56 · 0.45) = 25
    rng = np.random.default_rng(0)
    probes = feed(method, rng.random(12) * 0.5)
    assert [i for i, p in enumerate(probes) if p.kind == "bayes"] == [4, 9]
    assert all(p.skip.size == n for p in probes)
    assert all(1 <= i <= 28 for p in probes for i in (*p.skip.attn, *p.skip.mlp))  # never the first or last layer
    method.bo_polish = False  # the cheap acquisition maximiser: same encoding
    point, skip = method._suggest()
    assert skip.size == n and len(point) == 56


def test_threshold_encoding_lets_the_count_vary():
    method = Swift(skip_ratio=0.3, encoding="threshold", bayes_interval=0)
    method.start(12)
    sizes = {p.skip.size for p in feed(method, [0.1] * 30)}
    assert len(sizes) > 3


def test_stop_rules_and_scope():
    method = Swift(skip_ratio=0.3, patience=5, max_steps=50, bayes_interval=0, context_window=4)
    method.start(10)
    assert method.probe(5) is None and method.probe(6) is not None  # more than context_window + 1 tokens
    assert len(feed(method, [0.2, 0.1, 0.1, 0.1, 0.1, 0.1, 0.9])) == 6  # 5 steps without improvement: stop
    assert method.stopped == "patience" and method.best == 0.2
    method.start(10)
    assert method.stopped == "patience" and method.probe(100) is None  # scope run: stays stopped, set frozen
    short = Swift(skip_ratio=0.3, max_steps=3, bayes_interval=0, scope="prompt")
    short.start(10)
    assert len(feed(short, [0.1, 0.2, 0.3, 0.4])) == 3 and short.stopped == "max_steps"
    short.start(10)
    assert short.stopped is None and short.current == odd_layers(10) and short.best == 0.0  # per prompt: restart
    done = Swift(skip_ratio=0.3, bayes_interval=0)
    done.start(10)
    assert len(feed(done, [0.5, 0.96, 0.99])) == 2 and done.stopped == "matchness" and done.best == 0.96
    fixed = Swift(skip_set="attn:1,3;mlp:2")
    fixed.start(10)
    assert fixed.probe(100) is None and fixed.plan().skip == SkipSet(attn=(1, 3), mlp=(2,))


# ---- configuration and records ------------------------------------------------------------------------------------

@pytest.mark.parametrize("override, message", [
    ("method.skip_ratio=1.0", "skip_ratio"), ("method.skip_ratio=0", "skip_ratio"),
    ("method.encoding=onehot", "encoding"), ("method.scope=forever", "scope"),
    ("method.context_window=0", "context_window"), ("method.skip_set={attn:[3]}", "layers"),
    ("method.tree_widths=[1,3]", "tree_widths"), ("method.tree_widths=[0,3,5,10]", "tree_widths"),
    ("method.tree_confidences=[0.5,0.8,0.95]", "tree_confidences"),
])
def test_config_errors_fail_before_a_model_loads(run_cfg, override, message):
    cfg = run_cfg("method=swift", override)
    with pytest.raises(ConfigError, match=message):
        runner.run(cfg, load=lambda: pytest.fail("the model must not load"))


def test_a_run_records_its_sets_and_a_later_run_reuses_the_best(run_cfg, tmp_path):
    vanilla = runner.run(run_cfg("method=vanilla", "max_new_tokens=30", f"out_dir={tmp_path / 'vanilla'}"))
    runner.run(run_cfg("method=swift", "max_new_tokens=30", "method.context_window=4",
                                  "method.bayes_interval=3", f"out_dir={tmp_path / 'searched'}"))
    rounds = [json.loads(line) for line in (tmp_path / "searched" / "rounds.jsonl").read_text().splitlines()]
    firsts = [r for r in rounds if r["round"] == 1]
    assert len(firsts) == 3 and all(r["skip_set"] for r in firsts)  # every prompt names its set
    assert any("opt_matchness" in r for r in rounds) and all(r["exit_layer"] is None for r in rounds)
    samples = [json.loads(line) for line in (tmp_path / "searched" / "samples.jsonl").read_text().splitlines()]
    for s in samples:
        mine = [r for r in rounds if r["sample_id"] == s["sample_id"]]
        assert s["loaded_layers"] == pytest.approx(sum(r["loaded_layers"] for r in mine))
    best = skip_set_of(tmp_path / "searched")
    assert best.size == skip_count(4, 0.45)
    reused = runner.run(run_cfg("method=swift", "max_new_tokens=30", f"method.skip_set={tmp_path / 'searched'}",
                                "method.tag=swift-reused", f"out_dir={tmp_path / 'reused'}"))
    assert reused["run_key"]["hyperparameters"]["skip_set"] == compact(best)
    outputs = {name: [json.loads(line)["output_ids"] for line in (tmp_path / name / "samples.jsonl").read_text()
                      .splitlines()] for name in ("vanilla", "searched", "reused")}
    assert outputs["searched"] == outputs["vanilla"] == outputs["reused"]
    assert vanilla["n_samples"] == 3
