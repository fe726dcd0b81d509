"""The matrix products' layout (del_bench/models/products.py): `auto` keeps what the timings say, per shape class and
row class, and never a layout that x_wt (HF's) beats; forced settings and half precision time nothing; both layouts
compute the same product (test_engine and test_fused hold the tokens under each forced one); the fused loop follows a
mixed choice bit for bit; a run records the choice and the timings behind it."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from del_bench import records, runner
from del_bench.engine.decode import Engine
from del_bench.engine.path_choice import stack_of
from del_bench.engine.sampling import Sampling
from del_bench.errors import ConfigError
from del_bench.methods.ls import LayerSkip
from del_bench.models import layer_stack, products
from del_bench.models.layer_stack import LayerStack
from del_bench.models.products import WT_X, X_WT, X_WT_COPY, choose, product, products_for, tune_rows
from del_bench.records import RunDir
from tests.conftest import tiny_model
from tests.test_engine import PROMPTS, hf_greedy

# a winner for every (shape class, row class): each candidate wins somewhere, x_wt_copy where it may (one head row)
MIXED = {("qkv", "one"): WT_X, ("qkv", "many"): X_WT, ("o", "one"): X_WT, ("o", "many"): WT_X,
         ("gate_up", "one"): X_WT, ("gate_up", "many"): WT_X, ("down", "one"): WT_X, ("down", "many"): X_WT,
         ("head", "one"): X_WT_COPY, ("head", "many"): WT_X}


def fake_timer(winners: dict, calls: list | None = None):
    """seconds(shape, layout, rows): 1 ms for every candidate, 0.5 ms for the winner of its shape and row class."""

    def seconds(shape: str, layout: str, rows: int) -> float:
        if calls is not None:
            calls.append((shape, layout, rows))
        return 0.5e-3 if winners[shape, "one" if rows == 1 else "many"] == layout else 1e-3

    return seconds


def test_auto_keeps_the_fastest_candidate_of_each_shape_and_row_class():
    calls = []
    chosen = choose("auto", torch.float32, fake_timer(MIXED, calls))
    assert {(shape, rows): getattr(chosen[shape], rows) for shape, rows in MIXED} == MIXED
    assert chosen.setting == "auto" and chosen.setup_s >= 0
    # every candidate at 1 row and at 2-5 rows, the head's copy at one row only; the timings are kept
    assert sorted({rows for _, _, rows in calls}) == [1, 2, 3, 4, 5]
    assert {layout for shape, layout, rows in calls if layout == X_WT_COPY} == {X_WT_COPY}
    assert all(shape == "head" and rows == 1 for shape, layout, rows in calls if layout == X_WT_COPY)
    assert len(calls) == 5 * 2 * 5 + 1
    assert chosen.seconds["head"][1] == {X_WT: 1e-3, WT_X: 1e-3, X_WT_COPY: 0.5e-3}


def test_another_layout_must_beat_hf_by_the_margin():
    """Never slower than generate's own layout by more than the timing's noise: a near-tie keeps x_wt."""
    near = {X_WT: 1.0, WT_X: 1.0 - products.MARGIN / 2}
    assert products.pick(near) == X_WT
    assert products.pick({X_WT: 1.0, WT_X: 1.0 - 2 * products.MARGIN}) == WT_X
    assert products.pick({X_WT: 1.0, WT_X: 1.5, X_WT_COPY: 0.9}) == X_WT_COPY


def test_several_rows_are_judged_over_2_to_5_rows_together():
    """wt_x faster at 2 rows but far slower at 4 and 5 (a verification batch of any size): x_wt."""

    def seconds(shape, layout, rows):
        if layout == X_WT:
            return 1.0
        return {1: 0.5, 2: 0.5, 3: 1.0}.get(rows, 2.0)

    chosen = choose("auto", torch.float64, seconds)
    assert all(chosen[shape].many == X_WT for shape in products.SHAPES)
    assert all(chosen[shape].one != X_WT for shape in products.SHAPES)


def never_timed(*_):
    raise AssertionError("a setting that fixes the layout must time nothing")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_is_hfs_product_whatever_the_setting(dtype):
    """HF's layout always; under auto its one-row time of each shape class is still taken — the machine's probe
    (records.machine_probe), so a half-precision run's speedups can be marked § too."""
    for setting in ("wt_x", "x_wt"):
        assert all(lay == products.HF_LAYOUT for lay in choose(setting, dtype, never_timed).layouts.values())
    timed = []
    auto = choose("auto", dtype, lambda shape, layout, rows: timed.append((shape, layout, rows)) or 1e-3)
    assert all(lay == products.HF_LAYOUT for lay in auto.layouts.values())
    assert timed == [(shape, X_WT, 1) for shape in products.SHAPES]
    assert records.machine_probe([{"products": json.loads(json.dumps(auto.as_dict()))}]) == \
        pytest.approx(1e-3 * len(products.SHAPES))


def test_forced_settings_time_nothing():
    tuned = choose("wt_x", torch.float32, never_timed)
    assert [tuned[s] for s in products.LAYER_SHAPES] == [products.TUNED] * 4 and tuned["head"] == products.TUNED_HEAD
    assert all(lay == products.HF_LAYOUT for lay in choose("x_wt", torch.float64, never_timed).layouts.values())
    with pytest.raises(ValueError, match="choose one of auto, wt_x, x_wt"):
        choose("xw", torch.float32, never_timed)


@pytest.mark.parametrize("rows", [1, 2, 5])
def test_both_layouts_compute_the_product(rows):
    """float64: the same product to rounding; x_wt is nn.Linear's call bit for bit, and in half precision its residual
    is added as its own op, as HF rounds it (an addmm would round once)."""
    g = torch.Generator().manual_seed(rows)
    x, w, r = (torch.randn(*shape, generator=g, dtype=torch.float64) for shape in ((rows, 48), (80, 48), (rows, 80)))
    for layout in (X_WT, WT_X):
        torch.testing.assert_close(product(x, w, layout), F.linear(x, w), rtol=1e-13, atol=1e-13)
        torch.testing.assert_close(product(x, w, layout, r), r + F.linear(x, w), rtol=1e-13, atol=1e-13)
        assert product(x, w, layout).shape == (rows, 80)
    assert torch.equal(product(x, w, X_WT), F.linear(x, w))
    xb, wb, rb = (t.to(torch.bfloat16) for t in (x, w, 8 * r))
    assert torch.equal(product(xb, wb, X_WT, rb), rb + F.linear(xb, wb))


@pytest.fixture
def mixed_timings(monkeypatch):
    """LayerStack's `auto` sees the MIXED timings (no clock read)."""
    monkeypatch.setattr(layer_stack, "time_products", lambda stack: fake_timer(MIXED))


def test_the_fused_loop_follows_a_mixed_choice_bit_for_bit(mixed_timings):
    """Each shape class in its own layout, another at one row than at several: `layers=fused` builds only if the
    C++ loop gives the eager loop's bits (fused.check), and both decode HF's greedy tokens."""
    model, tok = tiny_model()
    prompt = tok(PROMPTS[0])["input_ids"]
    ref = hf_greedy(model, prompt, 30)
    eager = LayerStack(model, products="auto")
    fused_stack = stack_of(tiny_model()[0], layers="fused", products="auto")
    assert fused_stack.layer_path == "fused" and fused_stack.products.layouts == eager.products.layouts
    assert fused_stack.head_t is not None  # the head's one-row copy, kept only where it was chosen
    for stack in (eager, fused_stack):
        assert Engine(stack, Sampling(), set()).generate(prompt, LayerSkip(2, 3), 30, seed=0).output_ids == ref


def test_the_head_runs_in_the_layout_chosen_for_its_rows():
    """x_wt: HF's lm_head call bit for bit, at one row and at several, and no copy of the head; wt_x: one row from its
    [D, V] copy, several as W @ Xᵀ."""
    hn = torch.randn(1, 3, 64, generator=torch.Generator().manual_seed(0), dtype=torch.float64)  # [1, T, D]
    hf = LayerStack(tiny_model()[0], products="x_wt")
    assert hf.head_t is None
    for rows in (1, 3):
        assert torch.equal(hf.head(hn[:, :rows]), F.linear(hn[:, :rows], hf.head_weight))
    tuned = LayerStack(tiny_model()[0], products="wt_x")
    assert torch.equal(tuned.head(hn[:, :1]), hn[:, :1] @ tuned.head_t)
    assert torch.equal(tuned.head(hn), product(hn[0], tuned.head_weight, WT_X)[None])


def test_auto_times_every_candidate_on_the_model():
    chosen = LayerStack(tiny_model()[0], products="auto").products
    assert chosen.setting == "auto" and chosen.setup_s > 0
    assert all(t > 0 for shape in chosen.seconds.values() for by_rows in shape.values() for t in by_rows.values())
    assert all({lay.one, lay.many} <= {X_WT, WT_X, X_WT_COPY} for lay in chosen.layouts.values())


def test_a_run_records_the_layouts_and_a_resume_keeps_them(run_cfg, monkeypatch):
    """setup.jsonl (and the summary's setup) keeps each decoding session's choice and its timings; a resumed session
    decodes in the first session's layouts whatever its own timings say (one run, one layout's bits), and a
    `products` setting changed on resume is used."""
    monkeypatch.setattr(layer_stack, "time_products", lambda stack: fake_timer(MIXED))
    runner.run(run_cfg("method=vanilla", "limit=1", "products=auto"))
    monkeypatch.setattr(layer_stack, "time_products", lambda stack: fake_timer(dict.fromkeys(MIXED, X_WT)))
    runner.run(run_cfg("method=vanilla", "limit=2", "products=auto"))
    resumed = runner.run(run_cfg("method=vanilla", "limit=3", "products=x_wt"))
    setups = RunDir(resumed["config"]["out_dir"]).setup()
    (first, second, forced), reused = ([s["products"] for s in setups], [s["products_reused"] for s in setups])
    assert resumed["setup"][2]["products"] == forced and reused == [False, True, False]
    assert first["layouts"] == {shape: {"one": MIXED[shape, "one"], "many": MIXED[shape, "many"]}
                                for shape in products.SHAPES} and second == first
    assert first["seconds"]["head"]["1"] == {X_WT: 1e-3, WT_X: 1e-3, X_WT_COPY: 0.5e-3}  # (JSON keys: rows as text)
    assert forced == {"setting": "x_wt", "setup_s": 0.0, "seconds": {},
                      "layouts": {shape: {"one": X_WT, "many": X_WT} for shape in products.SHAPES}}
    with pytest.raises(ConfigError, match="products='xwt'.*Did you mean 'x_wt'"):
        runner.run(run_cfg("method=vanilla", "products=xwt"))


def test_a_batchs_width_gets_the_layouts_timed_at_it():
    """Batched decoding's ragged steps run wider than the verification batches auto timed: products.for_rows times
    every shape at the batch's width and keeps the fastest (the head and the layers may differ), the one-row layouts
    untouched; a forced setting and half precision keep theirs. products.products_for uses them only beyond 5 rows."""
    own = choose("auto", torch.float32, fake_timer(MIXED, []))
    calls = []

    def at_eight(shape, layout, rows):
        calls.append(rows)
        return {X_WT: 1.0, WT_X: 0.5 if shape == "head" else 2.0}[layout]

    wide = products.for_rows(own, torch.float32, at_eight, 8)
    assert set(calls) == {8}
    assert {shape: lay.many for shape, lay in wide.layouts.items()} == {**dict.fromkeys(products.LAYER_SHAPES, X_WT),
                                                                       "head": WT_X}
    assert {shape: lay.one for shape, lay in wide.layouts.items()} == {s: lay.one for s, lay in own.layouts.items()}
    forced = choose("wt_x", torch.float32, fake_timer(MIXED, []))
    assert products.for_rows(forced, torch.float32, at_eight, 8) is forced
    assert products.for_rows(own, torch.bfloat16, at_eight, 8) is own
    stack = LayerStack(tiny_model()[0], products="auto")
    stack.wide_products = wide
    for rows, expected in ((5, stack.products), (6, wide), (16, wide)):
        with products_for(stack, rows):
            assert stack.products is expected
    assert stack.products is not wide


@pytest.mark.skipif(not products.onednn(torch.float32, torch.device("cpu")), reason="torch without oneDNN here")
def test_onednn_blocked_copies_for_a_batchs_rows():
    """float32 on a CPU: oneDNN's blocked copies are a candidate at a batch's width; where they win, tune_rows keeps the
    winning shapes' copies (their bytes in packed_bytes) and drops the others' — and a product from them is x @ Wᵀ
    to float32's rounding, with the residual joined."""
    model, _ = tiny_model(torch.float32)
    stack = LayerStack(model, products="auto")
    w, x, r = stack.layers[0].w_gate_up, torch.randn(8, stack.layers[0].w_gate_up.shape[1]), None
    products.pack([w])
    try:
        torch.testing.assert_close(products.product(x, w, products.ONEDNN), x @ w.t())
        r = torch.randn(8, w.shape[0])
        torch.testing.assert_close(products.product(x, w, products.ONEDNN, r), r + x @ w.t())
    finally:
        products.unpack([w])
    assert products.packed(w) is None
    own = choose("auto", torch.float32, fake_timer(MIXED, []))
    wide = products.for_rows(own, torch.float32, lambda shape, layout, rows: 0.5 if layout == products.ONEDNN and
                             shape == "gate_up" else 1.0, 8, copied=(products.ONEDNN,))
    assert {s: lay.many for s, lay in wide.layouts.items()}["gate_up"] == products.ONEDNN
    assert not products.onednn(torch.float64, torch.device("cpu"))  # float64 (the tests' models): never a candidate
    tune_rows(stack, 8)  # timed for real: whichever won, the copies kept are exactly the winners'
    for shape in products.SHAPES:
        for layout in products.COPIED:
            kept = [products.packed(m, layout) is not None for m in products.matrices(stack, shape)]
            assert all(kept) == (stack.wide_products[shape].many == layout) and len(set(kept)) == 1
    assert stack.wide_products.packed_bytes == sum(
        products.packed(m, stack.wide_products[shape].many).numel() * 4 for shape in products.SHAPES
        for m in products.matrices(stack, shape) if stack.wide_products[shape].many in products.COPIED)


@pytest.mark.skipif(not products.panels(torch.float32, torch.device("cpu")), reason="no fused extension here")
@pytest.mark.parametrize("out_features", [64, 50])  # whole panels of 32 columns; a last one zero-padded
def test_panels_multiply_each_row_alone_whatever_rows_share_the_step(out_features):
    """The panels layout (fused_layers.cpp's panel_product): x @ Wᵀ to float32's rounding, the residual added after;
    each output a plain sum over the inner dimension, so every row of a step of 1..13 rows (the kernel's 8-, 4- and
    1-row blocks) has the bits of that row multiplied alone."""
    generator = torch.Generator().manual_seed(0)
    w = torch.randn(out_features, 40, generator=generator)
    x, r = torch.randn(13, 40, generator=generator), torch.randn(13, out_features, generator=generator)
    products.pack([w], products.PANELS)
    try:
        assert products.packed(w, products.PANELS).shape == (2, 40, 32) and products.packed(w) is None
        torch.testing.assert_close(products.product(x, w, products.PANELS), x @ w.t())
        torch.testing.assert_close(products.product(x, w, products.PANELS, r), r + x @ w.t())
        alone = torch.cat([products.product(x[i : i + 1], w, products.PANELS) for i in range(13)])
        for rows in (13, 8, 5, 4, 2):
            assert torch.equal(products.product(x[:rows], w, products.PANELS), alone[:rows]), rows
    finally:
        products.unpack([w], products.PANELS)
    assert products.packed(w, products.PANELS) is None
