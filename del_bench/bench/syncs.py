"""Host synchronisations counted independently of the engine (issue 26): what `Round.host_syncs` is held against.

`count_syncs(device)` is a context manager that counts, while it is open, every point where the host would wait for
a device: a `torch.overrides.TorchFunctionMode` sees every torch call made from Python and classifies it (kinds below);
on CUDA, `torch.cuda.set_sync_debug_mode("warn")` is switched on beside it and its warnings are counted — that count
is authoritative there (`SyncCounter.total`), the mode's classified count (`observed`) says where they came from.

Why a TorchFunctionMode and not a TorchDispatchMode: the function mode sees the Python-level reads themselves
(`.tolist()`, `int(t)`, `bool(t)`, `t.__index__`, `.numpy()`, `.cpu()` reach it by name), which the dispatcher does
not (`.tolist()`, `.numpy()` never dispatch an `aten` op; `int`/`float`/`bool` all arrive as `aten.item` or
`aten.is_nonzero`; `.cpu()` as a `to` indistinguishable from a dtype cast). While an op runs, the mode is popped,
so the calls torch makes inside it (`Tensor.__format__` calling `item`) are not counted twice.

Kinds (one count each, unless said otherwise):
- read: a Python value from tensor data — item, tolist, int/float/bool/complex/index of a tensor, numpy, __array__,
  __format__/__repr__, `in`, torch.equal/allclose/is_nonzero, and indexing with a 0-d integer or bool tensor (torch
  selects with its value) or with tensor slice bounds;
- download: a device → host copy — .cpu(), .to(cpu), copy_ into a CPU tensor (not with non_blocking=True: that
  queues the copy; the read of its result waits, and is what a later read counts);
- upload: a blocking host → device copy — torch.tensor/as_tensor/asarray of host data onto a device, .to(device) or
  .cuda() of a CPU tensor, copy_ from one (CUDA copies from pageable memory with non_blocking=False end in a stream
  synchronisation: sync debug mode reports them);
- shape: ops whose output shape depends on the data, so CUDA must read a count back before it can allocate —
  nonzero, argwhere, masked_select, unique, unique_consecutive, bincount, torch.where with only a condition,
  repeat_interleave with tensor repeats and no output_size, and indexing (or index assignment) with a boolean mask
  (one each: the least they cost on CUDA; some read more there, e.g. bincount its min and max, which the CUDA count
  sees);
- check: torch.multinomial with one sample or without replacement counts 2 — its validity checks read two values
  (`(max < inf & min >= 0).item()`, `(sum == 0).item()`, ATen's Distributions.cpp) before the Gumbel-max draw.
Not counted: sorting, topk, argmax, cumsum, random draws (the values stay on the device); torch.cuda.synchronize()
and Event.synchronize() (the engine's clock reads, outside the rounds' logic; sync debug mode does not report them
either); ops the fused C++ layer loop calls from C++ (no Python sees them: its token-tree mask uses nonzero, SWIFT
with `tree: true` only), where the CUDA count is the one to trust.

On a CPU every tensor is host memory and nothing waits, so the counter counts the would-be synchronisations of the
same code on an accelerator: every read (whatever the tensor), every explicit .cpu() — with a read chained straight
onto it (`t.cpu().numpy()`) counted once, as on CUDA, where the copy is the sync and the read of its result is free —
and every torch.tensor/as_tensor/asarray given an explicit `device=` (the code's way of putting host data where the
model lives). `.to(x.device)` and copy_ between CPU tensors are not counted on a CPU: nothing tells a move to the
model's device from a cast there. On an accelerator only reads and copies of non-CPU tensors count.

`measure(engine, method, prompts, ...)` runs Engine.generate under the counter → a SyncReport (syncs per round; per
round one by one where the engine calls `Engine.on_round` as it records each Round); `print_syncs` prints
such counts (bench-engine's syncs/round per method: its rows are counted again, untimed, by bench/engine.py's
bench_syncs, on engines set up as their runs were, session.build).
"""

from __future__ import annotations

import os
import re
import sys
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import torch
from torch.overrides import TorchFunctionMode

CUDA_SYNC_MESSAGE = "called a synchronizing CUDA operation"  # c10/cuda: warn_or_error_on_sync under "warn"
KINDS = ("read", "download", "upload", "shape", "check")

READS = frozenset({"item", "tolist", "__int__", "__float__", "__bool__", "__complex__", "__index__", "numpy",
                   "__array__", "__format__", "__repr__", "__contains__", "equal", "allclose", "is_nonzero"})
SHAPES = frozenset({"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "bincount"})
CREATIONS = frozenset({"tensor", "as_tensor", "asarray"})
_HERE = os.path.abspath(__file__)
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def _tensors(values) -> Iterator[torch.Tensor]:
    """The tensors among values (nested one level in tuples/lists, as indices and tensor lists are)."""
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (tuple, list)):
            yield from (t for t in v if isinstance(t, torch.Tensor))


def _on_device(t) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type not in ("cpu", "meta")


def _index_parts(index) -> tuple:
    return index if isinstance(index, tuple) else (index,)


def _is_mask(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)


def _index_reads(index) -> int:
    """Values torch reads from tensors inside an index: a 0-d integer or bool tensor (selected by its value) and
    tensor slice bounds."""
    reads = 0
    for part in _index_parts(index):
        if isinstance(part, slice):
            reads += sum(isinstance(b, torch.Tensor) for b in (part.start, part.stop, part.step))
        elif isinstance(part, torch.Tensor) and part.dim() == 0 and not part.is_floating_point():
            reads += 1  # ATen's applySlicing: tensor.item() (a 0-d bool/uint8 mask too, as a Python bool)
    return reads


def _target_device(args, kwargs) -> tuple[torch.device | None, bool]:
    """Tensor.to's (target device or None, non_blocking), however its arguments were spelled."""
    device, _, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
    return device, non_blocking


class _Rules:
    """Which torch calls are host synchronisations, and of what kind (the module docstring's list). `host`: the code
    runs on a CPU, so the would-be synchronisations count."""

    def __init__(self, host: bool):
        self.host = host

    def syncs(self, name: str, args: tuple, kwargs: dict) -> list[tuple[str, int]]:
        """(kind, count) pairs of one call (usually none)."""
        if name in READS:
            return self._read(args)
        if name == "cpu":
            return [("download", 1)] if self.host or _on_device(args[0]) else []
        if name in ("to", "cuda", "copy_"):
            return self._copy(name, args, kwargs)
        if name in CREATIONS:
            return self._creation(name, args, kwargs)
        if name in ("__getitem__", "__setitem__"):
            return self._index(args)
        return self._shape(name, args, kwargs)

    def _counts(self, tensors) -> bool:
        """On a CPU every tensor counts; on an accelerator only those not on the host."""
        return self.host or any(_on_device(t) for t in tensors)

    def _read(self, args) -> list[tuple[str, int]]:
        return [("read", 1)] if self._counts(_tensors(args)) else []

    def _copy(self, name, args, kwargs) -> list[tuple[str, int]]:
        if self.host:  # a move to the model's device reads as a cast on a CPU: not counted (docstring)
            return []
        source = args[0] if name != "copy_" else args[1]
        if name == "to":
            target, non_blocking = _target_device(args[1:], kwargs)
        elif name == "cuda":
            target, non_blocking = torch.device("cuda"), kwargs.get("non_blocking", False)
        else:
            target, non_blocking = args[0].device, kwargs.get("non_blocking", len(args) > 2 and args[2])
        if non_blocking or not isinstance(source, torch.Tensor) or target is None:
            return []
        if _on_device(source) and target.type == "cpu":
            return [("download", 1)]
        if not _on_device(source) and target.type not in ("cpu", "meta"):
            return [("upload", 1)]
        return []

    def _creation(self, name, args, kwargs) -> list[tuple[str, int]]:
        data = args[0] if args else kwargs.get("data", kwargs.get("obj"))
        device = kwargs.get("device", args[2] if name == "as_tensor" and len(args) > 2 else None)
        if device is None or _on_device(data):
            return []
        if self.host or torch.device(device).type not in ("cpu", "meta"):
            return [("upload", 1)]
        return []

    def _index(self, args) -> list[tuple[str, int]]:
        tensor, index = args[0], args[1]
        parts = _index_parts(index)
        counted = []
        if any(_is_mask(p) and p.dim() > 0 for p in parts) and self._counts([tensor, *_tensors(parts)]):
            counted.append(("shape", 1))
        reads = _index_reads(index)
        if reads and self._counts([tensor, *_tensors(parts)]):
            counted.append(("read", reads))
        return counted

    def _shape(self, name, args, kwargs) -> list[tuple[str, int]]:
        tensors = list(_tensors(args))
        if not self._counts(tensors):
            return []
        if name in SHAPES:
            return [("shape", 1)]
        if name == "where" and len(args) + len(kwargs) == 1:
            return [("shape", 1)]
        if name == "repeat_interleave" and kwargs.get("output_size") is None:
            repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
            return [("shape", 1)] if isinstance(repeats, torch.Tensor) and repeats.numel() > 1 else []
        if name == "multinomial":
            samples = args[1] if len(args) > 1 else kwargs.get("num_samples")
            replacement = args[2] if len(args) > 2 else kwargs.get("replacement", False)
            return [("check", 2)] if samples == 1 or not replacement else []
        return []


def _frame_name(frame) -> str:
    path = frame.f_code.co_filename
    rel = os.path.relpath(path)
    return f"{path if rel.startswith('..') else rel}:{frame.f_lineno} {frame.f_code.co_name}"


def _call_site() -> str:
    """The innermost frame outside torch and this file, and its caller (a read often goes through a helper, like the
    engine's transfer functions): `path:line function ← path:line function`, paths relative to the working directory
    where they lie below it."""
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename.startswith(_TORCH_DIR)
                                 or os.path.abspath(frame.f_code.co_filename) == _HERE):
        frame = frame.f_back
    if frame is None:
        return "?"
    return _frame_name(frame) + (f" ← {_frame_name(frame.f_back)}" if frame.f_back is not None else "")


class _Mode(TorchFunctionMode):
    def __init__(self, counter: SyncCounter, rules: _Rules):
        super().__init__()
        self.counter, self.rules = counter, rules
        self.downloaded = None  # a CPU run's tensor just returned by .cpu(): a read chained onto it is the same sync

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        counted = self.rules.syncs(name, args, kwargs)
        if counted and counted[0][0] == "read" and args and args[0] is self.downloaded:
            counted = []  # t.cpu().numpy(): on an accelerator the copy waited, the read of its result does not
        self.downloaded = result if name == "cpu" and self.rules.host else None
        if counted:
            self.counter.add(name, counted, _call_site())
        return result


@dataclass
class SyncCounter:
    """Host synchronisations seen while `count_syncs` was open. total: sync debug mode's count on CUDA, else the
    classified one (observed); kinds: per kind (KINDS); ops: per torch call; sites: per `path:line function` of the
    code that made them (← its caller); segments: the counts between successive cut() calls (a round each: measure)."""

    device: torch.device
    kinds: Counter = field(default_factory=Counter)
    ops: Counter = field(default_factory=Counter)
    sites: Counter = field(default_factory=Counter)
    cuda_syncs: int | None = None  # torch's own count (CUDA only)
    segments: list[int] = field(default_factory=list)
    _cut_at: int = 0

    @property
    def observed(self) -> int:
        return sum(self.kinds.values())

    @property
    def total(self) -> int:
        return self.cuda_syncs if self.cuda_syncs is not None else self.observed

    def add(self, op: str, counted: list[tuple[str, int]], site: str) -> None:
        for kind, n in counted:
            self.kinds[kind] += n
            self.ops[op] += n
            self.sites[site] += n

    def cut(self) -> int:
        """Close a segment (e.g. a round): the syncs since the previous cut, also appended to segments."""
        now = self.total
        self.segments.append(now - self._cut_at)
        self._cut_at = now
        return self.segments[-1]


@contextmanager
def _sync_warnings_counted(counter: SyncCounter):
    """While open, torch's sync-debug warnings are counted into counter.cuda_syncs (each one, not shown); every other
    warning is shown as usual."""
    counter.cuda_syncs = 0
    with warnings.catch_warnings():
        shown = warnings.showwarning

        def count(message, category, filename, lineno, file=None, line=None):
            if CUDA_SYNC_MESSAGE in str(message):
                counter.cuda_syncs += 1
            else:
                shown(message, category, filename, lineno, file, line)

        warnings.filterwarnings("always", message=".*" + re.escape(CUDA_SYNC_MESSAGE))
        warnings.showwarning = count
        yield


@contextmanager
def _cuda_sync_debug(counter: SyncCounter):
    """torch.cuda.set_sync_debug_mode("warn") while open, its warnings counted; the previous mode restored."""
    previous = torch.cuda.get_sync_debug_mode()
    with _sync_warnings_counted(counter):
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(previous)


@contextmanager
def count_syncs(device: torch.device | str = "cpu") -> Iterator[SyncCounter]:
    """Count host synchronisations while open, for code running on `device` (the module docstring: what counts, and
    on a CPU what would). → a SyncCounter, live while open."""
    device = torch.device(device)
    counter = SyncCounter(device)
    with _Mode(counter, _Rules(host=device.type == "cpu")):
        if device.type == "cuda":
            with _cuda_sync_debug(counter):
                yield counter
        else:
            yield counter


# ---- one engine's syncs per round --------------------------------------------------------------------------------
@dataclass
class SyncReport:
    """A method's host syncs over some prompts. per_round: total ÷ rounds (prefill rounds included); rounds_syncs:
    each round's count (prefill first, what follows the last round folded into it) where the engine calls on_round,
    else None; engine_syncs: the engine's own Round.host_syncs where it records them, else None."""

    rounds: int
    total: int
    kinds: dict[str, int]
    ops: dict[str, int]
    sites: dict[str, int]
    rounds_syncs: list[int] | None = None
    engine_syncs: list[int] | None = None

    @property
    def per_round(self) -> float:
        return self.total / max(1, self.rounds)

    @property
    def worst_round(self) -> int | None:
        """The most syncs any round made (None without per-round attribution)."""
        return max(self.rounds_syncs) if self.rounds_syncs else None

    @property
    def engine_per_round(self) -> float | None:
        """The engine's own count (Round.host_syncs) ÷ rounds, where it keeps one."""
        return None if self.engine_syncs is None else sum(self.engine_syncs) / max(1, self.rounds)

    def as_dict(self, sites: int = 10) -> dict:
        """JSON-ready, the derived numbers included; the `sites` call sites that made the most."""
        return {**asdict(self), "per_round": self.per_round, "worst_round": self.worst_round,
                "engine_per_round": self.engine_per_round, "sites": dict(list(self.sites.items())[:sites])}


def _generate_attributed(engine, counter: SyncCounter, generate: Callable) -> object:
    """Run generate() with a cut at each recorded round (through Engine.on_round, where the engine has it); what
    follows the last round (deferred scoring) joins it. → the Generation."""
    if not hasattr(engine, "on_round"):
        return generate()
    first = len(counter.segments)
    previous, engine.on_round = engine.on_round, lambda record: counter.cut()
    try:
        gen = generate()
    finally:
        engine.on_round = previous
    tail = counter.cut()
    if len(counter.segments) - first > 1:
        counter.segments.pop()
        counter.segments[-1] += tail
    return gen


def measure(engine, method, prompts: list[list[int]], max_new_tokens: int, seed: int = 0,
            warmup: bool = True) -> SyncReport:
    """Engine.generate for each prompt (token ids) under count_syncs on the engine's device → a SyncReport. warmup:
    one uncounted generate first, so one-time work (lazy setup, first-call caches) is not charged to the rounds."""
    if warmup and prompts:
        engine.generate(prompts[0], method, max_new_tokens, seed=seed)
    rounds, engine_syncs = 0, []
    with count_syncs(engine.device) as counter:
        for prompt in prompts:
            gen = _generate_attributed(engine, counter,
                                       lambda prompt=prompt: engine.generate(prompt, method, max_new_tokens, seed=seed))
            rounds += len(gen.rounds)
            engine_syncs += [getattr(r, "host_syncs", None) for r in gen.rounds]
    attributed = hasattr(engine, "on_round") and len(counter.segments) == rounds
    return SyncReport(rounds=rounds, total=counter.total, kinds=dict(counter.kinds), ops=dict(counter.ops),
                      sites=dict(counter.sites.most_common()),
                      rounds_syncs=list(counter.segments) if attributed else None,
                      engine_syncs=None if None in engine_syncs else engine_syncs)


def print_syncs(rows: list[dict], sites: int = 3) -> None:
    """bench-engine's table of SyncReport.as_dict() rows (each with its "row" label): rounds, syncs, syncs/round, the
    worst round (where attributed), the engine's own count per round (where it keeps one), per kind, and the call
    sites that made the most."""
    print("  host syncs, counted independently of the engine (bench/syncs.py), untimed; engine: Round.host_syncs")
    width = max([22, *(len(r["row"]) for r in rows)])
    print(f"  {'row':<{width}} {'rounds':>6} {'syncs':>6} {'/round':>7} {'worst':>5} {'engine':>7}  kinds; top sites")
    for r in rows:
        worst = "" if r["worst_round"] is None else str(r["worst_round"])
        engine = "" if r["engine_per_round"] is None else f"{r['engine_per_round']:.2f}"
        kinds = ", ".join(f"{k} {n}" for k, n in r["kinds"].items())
        top = "; ".join(f"{n}× {s}" for s, n in list(r["sites"].items())[:sites])
        print(f"  {r['row']:<{width}} {r['rounds']:>6} {r['total']:>6} {r['per_round']:>7.2f} {worst:>5} {engine:>7}  "
              f"{kinds}; {top}")
