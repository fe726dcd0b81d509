"""The layout of the decoder layers' and the LM head's matrix products, chosen by measurement at load (`products` in
configs/run.yaml; LayerStack runs them, fused_layers.cpp's `product` the same ops).

Every product reads HF's own [out, in] matrix (q|k|v, o, gate|up, down: one per layer; the head: [V, D]) and runs as
- x_wt: x @ Wᵀ, HF's own product (nn.Linear's GEMM over the rows);
- wt_x: W @ Xᵀ with X repeated to at least two rows: MKL's few-column GEMM. Tuned at 2 threads on the AMD host of
  this machine kind, where it streamed SmolLM2's matrices fastest (a verification batch of 2 cost ~1.1 single
  positions); at 1 thread the same layer products took 72.9 ms a token against x_wt's 29.8, and on an Intel host at 2
  threads our Vanilla ran at 0.76–0.86× HF generate with it;
- x_wt_copy (the LM head at one row only): x @ Wᵀ from a contiguous [D, V] copy of the head (a second copy in memory);
- onednn (a batch's rows only, float32 on a CPU with oneDNN: for_rows): x @ Wᵀ from oneDNN's blocked copy of W (a
  second copy in memory; torch.ops.mkldnn, inductor's own CPU linear) — on this machine's Intel host at 2 threads
  SmolLM2's gate|up and down matrices took 17.5 ms a pass at 8 rows against x_wt's 24.8 (MKL's few-row GEMM), 11.5 at
  one row against 13.5;
- panels (a batch's rows only, float32 on a CPU with the fused extension: for_rows): x @ Wᵀ from W copied into
  32-column panels, each streamed once for all the rows by fused_layers.cpp's panel_product (a second copy in
  memory) — where MKL's GEMM re-packs W on every few-row call; on the Intel host at 2 threads SmolLM2's four layer
  matrices took ~30 ms a pass at 8 rows against x_wt's ~44 and oneDNN's ~35. Each output is a plain sum over the
  inner dimension: a row's product has the same bits whatever rows share it.
What is fastest depends on the host, the thread count, the dtype and the shape, so `auto` times the candidates on the
model's own matrices at load, for each shape class and each row class — one row (drafting, Vanilla) and 2–5 rows
(verification) — and keeps x_wt, HF's, unless another beats it by MARGIN: never slower than generate's layout by more
than the timing's noise. wt_x is the layout tuned by hand before (the head's single row from its copy), x_wt HF's.
Half precision keeps x_wt everywhere whatever the setting: it rounds as HF's nn.Linear does (docs/design.md §2.8).
"""

from __future__ import annotations

import statistics
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from del_bench.numerics import HALF_DTYPES

SETTINGS = ("auto", "wt_x", "x_wt")
X_WT, WT_X, X_WT_COPY, ONEDNN, PANELS = "x_wt", "wt_x", "x_wt_copy", "onednn", "panels"
COPIED = (ONEDNN, PANELS)  # the layouts that multiply from a copy of the weight (pack)
# (id(weight), layout) → (the weight, weakly; its copy for that layout), while a stack runs the layout (tune_rows)
_PACKED: dict[tuple[int, str], tuple[weakref.ref, torch.Tensor]] = {}
LAYER_SHAPES = ("qkv", "o", "gate_up", "down")  # the Layer matrices: w_qkv, w_o, w_gate_up, w_down
SHAPES = (*LAYER_SHAPES, "head")
RESIDUAL_SHAPES = ("o", "down")  # joined to the residual stream: timed with it, as they run
ONE_ROW, FEW_ROWS = (1,), (2, 3, 4, 5)  # the row classes: drafting and Vanilla; verification batches
MARGIN = 0.03  # another layout must beat x_wt by this fraction of x_wt's time to be chosen (timing noise)


@dataclass(frozen=True)
class Layout:
    """One shape class's layout at one row and at several."""

    one: str
    many: str

    def at(self, rows: int) -> str:
        return self.one if rows == 1 else self.many


HF_LAYOUT = Layout(X_WT, X_WT)
TUNED = Layout(WT_X, WT_X)  # the hand-tuned layout (the LM head's single row: from its copy, TUNED_HEAD)
TUNED_HEAD = Layout(X_WT_COPY, WT_X)


@dataclass
class Products:
    """The layouts a LayerStack runs, per shape class, and how they were chosen: `seconds` (auto only) is what each
    candidate took, shape → rows → layout → seconds (the median of a few passes over every layer's matrix of the
    class), `setup_s` the time spent measuring."""

    setting: str
    layouts: dict[str, Layout]
    seconds: dict = field(default_factory=dict)
    setup_s: float = 0.0
    packed_bytes: int = 0  # the copied layouts' copies kept (products.tune_rows): a second copy in memory

    def __getitem__(self, shape: str) -> Layout:
        return self.layouts[shape]

    @staticmethod
    def of(recorded: dict) -> "Products":
        """The Products an as_dict() describes (a run's setup line: the choice an earlier session of it made)."""
        layouts = {shape: Layout(lay["one"], lay["many"]) for shape, lay in recorded["layouts"].items()}
        return Products(recorded["setting"], layouts, recorded.get("seconds", {}), recorded.get("setup_s", 0.0))

    def summary(self) -> str:
        """One line for logs: each shape class's layout at one row / at several."""
        return ", ".join(f"{shape} {lay.one}/{lay.many}" for shape, lay in self.layouts.items())

    def as_dict(self) -> dict:
        """What a run's setup records: the setting, the choice per shape class and the timings behind it."""
        return {"setting": self.setting, "setup_s": self.setup_s,
                "layouts": {shape: {"one": lay.one, "many": lay.many} for shape, lay in self.layouts.items()},
                "seconds": self.seconds, **({"packed_bytes": self.packed_bytes} if self.packed_bytes else {})}


def fixed(setting: str) -> Products:
    """A forced setting's layouts (no measuring)."""
    if setting == X_WT:
        return Products(setting, dict.fromkeys(SHAPES, HF_LAYOUT))
    return Products(setting, {**dict.fromkeys(LAYER_SHAPES, TUNED), "head": TUNED_HEAD})


def candidates(shape: str, rows: int) -> tuple[str, ...]:
    """The layouts timed for a shape class at `rows` rows: x_wt (HF's) always first."""
    return (X_WT, WT_X, X_WT_COPY) if shape == "head" and rows == 1 else (X_WT, WT_X)


def onednn(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the onednn layout can run here: float32 on a CPU whose torch has oneDNN."""
    return dtype == torch.float32 and device.type == "cpu" and torch.backends.mkldnn.is_available()


def panels(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the panels layout can run here: float32 on a CPU where the fused extension builds."""
    if dtype != torch.float32 or device.type != "cpu":
        return False
    from del_bench.models import fused

    return fused.available()


def copied_layouts(dtype: torch.dtype, device: torch.device) -> tuple[str, ...]:
    """The layouts from a copy of the weight that can run here (for_rows' extra candidates)."""
    return tuple(layout for layout, runs in ((ONEDNN, onednn), (PANELS, panels)) if runs(dtype, device))


def packed(weight: torch.Tensor, layout: str = ONEDNN) -> torch.Tensor | None:
    """weight's copy for a copied layout (pack): oneDNN's blocked one, or its panels; None if not made."""
    entry = _PACKED.get((id(weight), layout))
    return entry[1] if entry is not None and entry[0]() is weight else None


def copy_for(weight: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == ONEDNN:
        return torch.ops.mkldnn._reorder_linear_weight(weight, None)
    from del_bench.models import fused

    return fused.extension().panel_weights(weight)  # [⌈N/32⌉, K, 32]


def pack(weights: list[torch.Tensor], layout: str = ONEDNN) -> int:
    """Make (once) each weight's copy that `layout` (onednn | panels) reads → their bytes. A copy goes with its weight
    (keyed by identity: a tensor's == is elementwise)."""
    for w in weights:
        if packed(w, layout) is None:
            key = (id(w), layout)
            _PACKED[key] = (weakref.ref(w, lambda _, key=key: _PACKED.pop(key, None)), copy_for(w, layout))
    return sum(packed(w, layout).numel() * w.element_size() for w in weights)


def unpack(weights: list[torch.Tensor], layout: str = ONEDNN) -> None:
    """Drop these weights' copies for `layout` (no longer chosen)."""
    for w in weights:
        _PACKED.pop((id(w), layout), None)


def pick(seconds: dict[str, float], margin: float = MARGIN) -> str:
    """The fastest layout of {layout: seconds}; x_wt unless the fastest beats it by `margin` of its time."""
    fastest = min(seconds, key=seconds.get)
    return fastest if seconds[fastest] < (1 - margin) * seconds[X_WT] else X_WT


def choose(setting: str, dtype: torch.dtype, seconds: Callable[[str, str, int], float]) -> Products:
    """The layouts for `setting` (auto | wt_x | x_wt) and a model of `dtype`. seconds(shape, layout, rows): what one
    pass of that product takes (time_products on the model; a test injects its own), called only under auto."""
    if setting not in SETTINGS:
        raise ValueError(f"products={setting!r}: choose one of {', '.join(SETTINGS)}")
    t0 = time.perf_counter()
    if dtype in HALF_DTYPES:  # HF's layout always; under auto its one-row times are still taken: the machine's state
        probe = {shape: {1: {X_WT: seconds(shape, X_WT, 1)}} for shape in SHAPES} if setting == "auto" else {}
        return Products(setting, dict.fromkeys(SHAPES, HF_LAYOUT), probe, time.perf_counter() - t0)  # (machine_probe)
    if setting != "auto":
        return fixed(setting)
    times = {shape: {rows: {layout: seconds(shape, layout, rows) for layout in candidates(shape, rows)}
                     for rows in ONE_ROW + FEW_ROWS} for shape in SHAPES}
    layouts = {shape: Layout(pick(summed(times[shape], ONE_ROW)), pick(summed(times[shape], FEW_ROWS)))
               for shape in SHAPES}
    return Products(setting, layouts, times, time.perf_counter() - t0)


def for_rows(own: Products, dtype: torch.dtype, seconds: Callable[[str, str, int], float], rows: int,
             copied: tuple[str, ...] = ()) -> Products:
    """own's layouts with the several-rows one chosen again at `rows` rows, as `auto` chooses (x_wt unless another
    beats it by MARGIN): for batched decoding's steps, wider than the verification batches auto timed (on the AMD
    host at 8 rows x_wt took 0.56–0.79 of wt_x's time on SmolLM2's layer matrices, but 5× wt_x's on its LM head).
    copied: the layouts from a weight's copy that are candidates too (those that run here: copied_layouts). A forced
    setting, and half precision, keep own."""
    if own.setting != "auto" or dtype in HALF_DTYPES:
        return own
    times = {shape: {layout: seconds(shape, layout, rows) for layout in (*candidates(shape, rows), *copied)}
             for shape in SHAPES}
    layouts = {shape: Layout(lay.one, pick(times[shape])) for shape, lay in own.layouts.items()}
    return Products(own.setting, layouts, {**own.seconds, f"rows_{rows}": times}, own.setup_s)


def summed(times: dict[int, dict[str, float]], row_class: tuple[int, ...]) -> dict[str, float]:
    """{layout: seconds over the row class's row counts}, for the layouts timed at all of them."""
    layouts = set.intersection(*(set(times[rows]) for rows in row_class))
    return {layout: sum(times[rows][layout] for rows in row_class) for layout in layouts}


def product(x: torch.Tensor, weight: torch.Tensor, layout: str, residual: torch.Tensor | None = None) -> torch.Tensor:
    """x: [T, in] times weight: [out, in]ᵀ (+ residual [T, out]) → [T, out], computed in `layout` (x_wt or wt_x;
    x_wt_copy is the head's own path, LayerStack.head_logits). fused_layers.cpp's `product`: the same ops.

    x_wt in half precision adds the residual as its own op, as LlamaDecoderLayer does (addmm would round once where HF
    rounds the product and then the sum); in float32/float64 either layout joins it in one addmm."""
    if layout == ONEDNN:  # float32 only (for_rows): the sum rounds as addmm's
        if residual is None:
            return torch.ops.mkldnn._linear_pointwise(x, packed(weight), None, "none", [], "")
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, packed(weight), None, "add")
    if layout == PANELS:  # float32 only (for_rows): the product rounded, then the residual added
        from del_bench.models import fused

        return fused.extension().panel_product(x, packed(weight, PANELS), weight.shape[0], residual)
    if layout == X_WT:
        if residual is not None and x.dtype not in HALF_DTYPES:
            return torch.addmm(residual, x, weight.t())
        y = x @ weight.t()
        return y if residual is None else residual + y
    T = x.shape[0]
    rows = x if T > 1 else x.expand(2, -1).contiguous()  # [T', in], T' ≥ 2
    if residual is not None:  # residual + W @ Xᵀ in one kernel (the residual broadcast over the rows)
        return torch.addmm(residual.t(), weight, rows.t())[:, :T].t().contiguous()  # [T, out]
    return (weight @ rows.t())[:, :T].t().contiguous()  # [T, out]


def layer_matrices(stack) -> list[torch.Tensor]:
    """Every layer's four matrices in a decode step's order (q|k|v, o, gate|up, down, layer by layer), [out, in]."""
    return [getattr(layer, f"w_{shape}") for layer in stack.layers for shape in LAYER_SHAPES]


def matrices(stack, shape: str) -> list[torch.Tensor]:
    """Every matrix of a shape class in the stack, [out, in] each: one per layer, or the head."""
    if shape == "head":
        return [stack.head_weight]
    return [getattr(layer, f"w_{shape}") for layer in stack.layers]


def time_products(stack, reps: int = 3, warmup: int = 1) -> Callable[[str, str, int], float]:
    """seconds(shape, layout, rows) on the stack's own matrices: the median of `reps` passes (after `warmup`) of the
    product over every layer's matrix of the class in turn — streamed from memory as a decode step streams them, not
    one matrix kept hot in cache — on random rows of the model's dtype, on each matrix's device."""
    generator = torch.Generator().manual_seed(0)

    def seconds(shape: str, layout: str, rows: int) -> float:
        mats = matrices(stack, shape)
        if layout == X_WT_COPY:  # the head's [D, V] copy, made for the measurement only
            mats = [m.t().contiguous() for m in mats]
        xs = [torch.randn(rows, m.shape[1] if layout != X_WT_COPY else m.shape[0], generator=generator,
                          dtype=m.dtype).to(m.device) for m in mats]  # [rows, in] each
        res = [torch.zeros(rows, m.shape[0], dtype=m.dtype, device=m.device) if shape in RESIDUAL_SHAPES else None
               for m in mats]  # [rows, out] each

        def one_pass():
            for m, x, r in zip(mats, xs, res):
                if layout == X_WT_COPY:
                    x @ m
                else:
                    product(x, m, layout, r)

        held = [m for m in mats if packed(m, layout) is not None]  # the copies the stack runs already: kept
        if layout in COPIED:
            pack(mats, layout)  # made for the measurement (tune_rows keeps them where chosen)
        try:
            return statistics.median(stack.seconds(one_pass, reps, warmup))
        finally:
            if layout in COPIED:
                unpack([m for m in mats if not any(m is h for h in held)], layout)

    return seconds


def tune_rows(stack, rows: int) -> Products:
    """Time the products' layouts at `rows` rows (products.for_rows: batched decoding's steps, wider than the
    verification batches `auto` timed) for products_for; untimed setup, before a batch decodes. Where a layout from
    a copy wins (oneDNN's blocked one, or the panels: float32 on a CPU) the chosen shape classes' copies are made and
    kept (a second copy of those matrices in memory: `packed_bytes` in the setup line), the others dropped."""
    copied = copied_layouts(stack.dtype, stack.head_device) if len(stack.devices) == 1 else ()
    with torch.inference_mode():
        stack.wide_products = for_rows(stack.products, stack.dtype, time_products(stack), rows, copied)
        kept = 0
        for shape in SHAPES:
            mats = matrices(stack, shape)
            for layout in COPIED:
                if stack.wide_products[shape].many == layout:
                    kept += pack(mats, layout)
                else:
                    unpack(mats, layout)
        stack.wide_products.packed_bytes = kept
    return stack.wide_products


@contextmanager
def products_for(stack, rows: int) -> Iterator[None]:
    """The products' layouts for a ragged batch of `rows` positions: the stack's own (timed at one row and at
    FEW_ROWS), or beyond those rows the layouts tune_rows timed. Only the ragged steps of batched decoding ask
    (they run one at a time; B = 1 keeps its layouts and bits)."""
    if rows <= max(FEW_ROWS) or stack.wide_products is None:
        yield
        return
    own, stack.products = stack.products, stack.wide_products
    try:
        yield
    finally:
        stack.products = own
