"""The one place that decides a session's layer path (engine/layer_path.py): the stack's own loop (`layers`: the fused
C++ loop or the eager one), the graphs (`compile`, at the batch's size), and what a run config may not ask for.
Everything that decodes gets its path from here, once, when its session is built (session.build); nothing else
branches on these settings."""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable

import torch

from del_bench.engine import compiled
from del_bench.engine.batch import Batch
from del_bench.engine.decode import Engine, Request
from del_bench.engine.layer_path import LayerPath
from del_bench.engine.sampling import Sampling
from del_bench.engine.static_steps import memo
from del_bench.errors import ConfigError
from del_bench.methods.base import Method
from del_bench.models import fused
from del_bench.models.layer_stack import LayerStack
from del_bench.models.products import tune_rows
from del_bench.numerics import compare, gap_ulps, is_half

log = logging.getLogger(__name__)

LAYER_SETTINGS = ("auto", "fused", "eager")  # `layers` (configs/run.yaml): the stack's own loop


def stack_of(model, layers: str = "auto", products: str = "wt_x") -> LayerStack:
    """The model as a LayerStack on the loop `layers` asks for — eager (Python, the reference), fused (the C++ loop,
    an error where it cannot serve) or auto (fused where it builds, supports the model and matches eager bit for bit
    on the model's own weights here; else eager, the reason logged). products: the matrix products' layout
    (models/products.py)."""
    stack = LayerStack(model, products=products)
    install_loop(stack, layers)
    return stack


def install_loop(stack: LayerStack, layers: str) -> None:
    """Give the stack the loop `layers` asks for (stack_of's rules); stack.layer_path names it, layer_setup_s what
    building, loading and checking it took."""
    if layers not in LAYER_SETTINGS:
        raise ValueError(f"layers={layers!r}: choose one of {', '.join(LAYER_SETTINGS)}")
    if layers == "eager":
        stack.use_loop(None, 0.0)
        return
    t0 = time.perf_counter()
    try:
        ext = fused.built_for(stack)
    except fused.FusedUnavailable as err:
        if layers == "fused":
            raise
        # loud: eager gives the same tokens but decodes slower, and speeds of the two loops never pair (run_key)
        log.warning("layers=auto: the fused layer loop is unavailable, decoding with the eager loop (same tokens, "
                    "slower; records say layer_path=eager, `layers=fused` makes this an error): %s", err)
        stack.use_loop(None, time.perf_counter() - t0)
        return
    stack.use_loop(ext, time.perf_counter() - t0)


def choose(stack: LayerStack, setting: str, method: Method, max_new_tokens: int, reach: int, rows: int = 1
           ) -> LayerPath:
    """The session's layer path: its stack's loop (already installed: stack_of) and the graphs `compile` asks for —
    made and checked here, before any timed decode (choose_graphs' rules; for a batch of rows > 1 per (rows,
    width bucket), checked row by row) — with what the setup line records. reach: the longest sequence a row
    reaches (prompt + max_new_tokens + 1)."""
    setting = compiled.compile_setting(setting)
    if rows > 1 and len(stack.devices) > 1:
        raise ConfigError(f"batch_size={rows}: the model spans several devices ({', '.join(map(str, stack.devices))}), "
                          "and a batch's steps run on one: use batch_size=1")
    if rows == 1:
        graphs, info = choose_graphs(stack, setting, method, max_new_tokens, cache_len=reach)
        return LayerPath(stack, graphs, info)
    wide = {"wide_products": tune_rows(stack, rows).as_dict()}  # the products' layouts at the batch's width, untimed
    why = batch_refusal(method)
    if why is not None:
        if setting in ("on", "graphs"):
            raise compiled.CompileUnavailable(compile_refused(setting, method.name, why))
        return LayerPath(stack, None, {"compile": setting, "compiled": False, "reason": why, **wide})
    graphs, info = make_graphs(stack, setting, method, max_new_tokens, reach, batch=rows)
    return LayerPath(stack, graphs, {**info, **wide})


def batch_refusal(method: Method) -> str | None:
    """Why a batch of this method's rows runs its steps eagerly, never on graphs made for B rows (None: it can):
    steps that are not a round's chains (AdaDecode's layer-by-layer walk; a token tree's per-row masks)."""
    if method.draft_shape == "layer_parallel":
        return "AdaDecode's layer-by-layer steps"
    if getattr(method, "tree", False):
        return "SWIFT's token tree (a tree mask per row)"
    return None


def compile_refused(setting: str, method: str, why: str) -> str:
    return (f"compile={setting}: a batch of method={method} cannot run on graphs ({why}): use compile=auto or off, "
            f"or batch_size=1")


def problems(cfg, method_class: type, method: Callable[[], Method]) -> list[str]:
    """What the layer path refuses of a whole run config before a model loads (config.validate): a batch of a peer
    that decodes one prompt at a time (all but `generate`: Peer.batches); compile=on|graphs for a batch whose steps
    cannot run on graphs.
    method: makes the config's method (asked only where it matters)."""
    rows = int(cfg.get("batch_size", 1))
    if rows == 1:
        return []
    if getattr(method_class, "decoder", None) is not None:
        return [] if method_class.batches else [
            f"method={cfg.method.name} is transformers' own decoding (a peer row), which decodes one prompt at a time: "
            "use batch_size=1"]
    setting = compiled.compile_setting(cfg.get("compile", "auto"))
    why = batch_refusal(method()) if setting in ("on", "graphs") else None
    return [] if why is None else [compile_refused(setting, cfg.method.name, why)]


# ---- the graphs: made, checked, chosen ----------------------------------------------------------------------
def unsupported(stack: LayerStack) -> str | None:
    """Why the graph-captured steps cannot run this stack (None: they can). Half precision on a CPU can: its eager
    loop verifies row by row for a decode step's bits (LayerStack.exact_rows), the graphs attend the rows as one
    batch, and check holds them to the near-tie rule like any other kernel."""
    if len({lay.device for lay in stack.layers} | {stack.head_device}) > 1:
        return "the model spans several devices (device_map): a graph moves no tensor between them"
    return None


@torch.inference_mode()
def generate_reference(model, prompt: list[int], tokens: int) -> tuple[list[int], list[float]]:
    """transformers' greedy `generate` on the model's own modules: its tokens and the top-2 gap (ulps of the model's
    dtype) of each — the reference `check` holds the graphs to (no EOS: exactly `tokens` tokens)."""
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=tokens,
                         min_new_tokens=tokens, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), [gap_ulps(step[0], dtype=model.dtype) for step in out.logits]


@torch.inference_mode()
def check(stack: LayerStack, graphs: compiled.Graphs, method, tokens: int = 16, prompt: int = 6) -> str | None:
    """A short greedy decode of random ids with `method` (a copy) on the graphs, against `generate` on the same
    weights: None when it is lossless by the project's rule (float32/float64: equal; half precision: equal or first
    departing at a near-tie of generate's logits, numerics.compare), else what departed."""
    ids = torch.randint(0, stack.vocab_size, (prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    reference, gaps = generate_reference(stack.model, ids, tokens)
    engine = Engine(stack, Sampling(), set(), path=LayerPath(stack, graphs))
    output = engine.generate(ids, copy.deepcopy(method), tokens, 0).output_ids
    verdict = compare(output, reference, gaps if is_half(stack.dtype) else None)
    if verdict.kind in ("equal", "near_tie"):
        return None
    gap = "" if verdict.gap is None else f" (generate's top-2 gap {verdict.gap} ulps)"
    where = f"at token {verdict.position}{gap}"
    return f"a greedy decode on the graphs departs from generate's {where}: {output} vs {reference}"

@torch.inference_mode()
def check_rows(stack: LayerStack, graphs: compiled.Graphs, method, tokens: int = 16) -> str | None:
    """check for a batch's graphs: B rows of random prompts of different lengths decoded together on them,
    greedy, each row held to `generate` on its prompt by the same rule (None: lossless; else what departed)."""
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, stack.vocab_size, (4 + 3 * (b % 4),), generator=generator).tolist()
               for b in range(graphs.batch)]  # of different lengths, all within the smallest cache the graphs take
    batch = Batch(stack, graphs.batch, Sampling(), set(), cache_len=graphs.cache.max_len - 1,
                  path=LayerPath(stack, graphs))
    outputs: dict = {}

    def decode(slot, i):
        outputs[i] = (yield Request(prompts[i], copy.deepcopy(method), tokens, 0)).output_ids

    batch.run(range(len(prompts)), decode)
    for i, prompt in enumerate(prompts):
        reference, gaps = generate_reference(stack.model, prompt, tokens)
        verdict = compare(outputs[i], reference, gaps if is_half(stack.dtype) else None)
        if verdict.kind not in ("equal", "near_tie"):
            return (f"row {i} of a batch on the graphs departs from generate's at token {verdict.position}: "
                    f"{outputs[i]} vs {reference}")
    return None


def choose_graphs(stack: LayerStack, setting: str, method, max_new_tokens: int, cache_len: int = 1024,
           backend: str = "inductor", capture: bool | None = None, runner: type | None = None
           ) -> tuple[compiled.Graphs | None, dict]:
    """The graph-captured steps for `setting`, for an Engine to decode on (None: the stack's loop), and what the run's
    setup records: the setting, whether they run, how (`graph_kind`), compile_s (making the graphs and checking them,
    apart from any decode), the graphs made, and why not where they do not run (`reason`; `fallbacks`: kinds tried
    first). Made and checked once per stack and method configuration (memo): a bench resumes its interleaved runs a
    prompt at a time, and each resume asks again (the setup line says `reused`).

    - off: the stack's loop.
    - on: the fused graphs — on CUDA inductor's kernels captured as CUDA graphs, elsewhere torch.compile'd steps — or
      an error (compiled.CompileUnavailable) where they cannot be made or are not lossless.
    - graphs: CUDA graphs of the eager kernels (unfused; CUDA only), or an error.
    - auto, the default: on CUDA the fused graphs where they are made and lossless, else the unfused ones, else the
      stack's loop, each refusal logged and recorded; elsewhere the stack's loop (compiled steps are no faster than
      the fused C++ loop on a CPU and cost minutes to compile: `make bench-compile`).
    cache_len: the slots the run's longest prompt needs (prompt + max_new_tokens + 1): CUDA graphs are captured on
    one cache that long."""
    setting = compiled.compile_setting(setting)
    shape = compiled.StepShapes.of(method, max_new_tokens)
    key = (setting, capture, runner, str(backend), shape.key(), -(-max(cache_len, 64) // compiled.CACHE_QUANTUM),
           type(method).__name__, repr(sorted(method.describe().items())))
    made = memo(stack).setdefault("chosen_graphs", {})
    if key in made and setting in compiled.COMPILE_CHOICES:
        graphs, info = made[key]
        if graphs is not None:
            graphs.declined.clear()
        return graphs, {**info, "compile_s": 0.0, "reused": True}
    made[key] = make_graphs(stack, setting, method, max_new_tokens, cache_len, backend, capture, runner)
    return made[key]


def make_graphs(stack: LayerStack, setting: str, method, max_new_tokens: int, cache_len: int, backend="inductor",
                capture: bool | None = None, runner: type | None = None, batch: int = 1
                ) -> tuple[compiled.Graphs | None, dict]:
    """The graphs `setting` asks for, by choose's rules — one prompt at a time (checked by `check`), or a batch's of
    B > 1 rows (by `check_rows`) — made and checked, or None, with what the setup line records."""
    setting = compiled.compile_setting(setting)
    if setting not in compiled.COMPILE_CHOICES:
        raise ValueError(f"compile={setting!r}: choose one of {', '.join(compiled.COMPILE_CHOICES)}")
    info: dict = {"compile": setting, "compiled": False}
    on_cuda = stack.head_device.type == "cuda" if capture is None else capture
    if setting == "off":
        return None, info
    if setting == "auto" and not on_cuda:
        return None, {**info, "reason": "auto makes graphs on CUDA only (compile=on compiles them here)"}
    if setting == "graphs" and not on_cuda:
        raise compiled.CompileUnavailable("compile=graphs captures CUDA graphs: the model is not on CUDA")
    tries = {"on": [True], "graphs": [False], "auto": [True, False]}[setting]  # fuse, in order
    t0 = time.perf_counter()
    for fuse in tries:
        try:
            graphs = _made(stack, method, max_new_tokens, cache_len, backend, capture, runner, fuse, batch)
        except compiled.CompileUnavailable as err:
            if setting != "auto":
                raise
            info.setdefault("fallbacks", []).append(str(err))
            log.warning("compile=auto: %s graphs not used: %s", "fused" if fuse else "unfused", err)
            continue
        graphs.declined.clear()  # from here on: the run's own calls
        return graphs, {**info, "compiled": True, "graph_kind": graphs.kind, "compile_s": time.perf_counter() - t0,
                        "graphs": graphs.graphs, **graphs.setup()}
    log.warning("compile=auto: decoding without the graph-captured steps (records say so)")
    return None, {**info, "compile_s": time.perf_counter() - t0, "reason": info["fallbacks"][-1]}


def _made(stack: LayerStack, method, max_new_tokens: int, cache_len: int, backend, capture, runner,
          fuse: bool, batch: int = 1) -> compiled.Graphs:
    """Graphs made for the method's shapes (a batch's: their rows' chains) and checked against `generate` (a batch's
    row by row), or CompileUnavailable saying why not."""
    reason = unsupported(stack)
    if reason:
        raise compiled.CompileUnavailable(reason)
    graphs = compiled.Graphs(stack, backend=backend, capture=capture, runner=runner, fuse=fuse, batch=batch)
    shape = compiled.StepShapes.of(method, max_new_tokens)
    try:
        if batch > 1:
            graphs.prepare_rows(shape, max(cache_len, 64))
            departure = check_rows(stack, graphs, method)
        else:
            graphs.prepare(shape, max(cache_len, 64))
            departure = check(stack, graphs, method)
    except Exception as err:  # a graph break (fullgraph), an unsupported op, a capture failure: all mean "not these"
        raise compiled.CompileUnavailable(f"making the graphs failed ({type(err).__name__}: {err})") from err
    if departure:
        raise compiled.CompileUnavailable(departure)
    return graphs
