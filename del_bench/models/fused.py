"""The fused decoder-layer loop (fused_layers.cpp): built once per machine and torch version, then checked against
the eager loop before a LayerStack uses it.

Why C++ and not torch.compile (make bench-compile, the testbed, time ÷ eager's): a per-layer graph takes 0.92× (each
call pays its guards and wrapper), a whole-stack graph 0.63× — about the fused loop's 0.65× — but only after ~70 s
of compiling per (layer range, batch width), and DEL picks a new E every round; and neither gives eager's bits. The
C++ loop calls the same ATen kernels as the eager path with none of the Python between them, so it needs no shapes
fixed ahead (one build serves every batch width, prefill, drafting, verification and token trees) and gives the same
bits. `layers` (configs/run.yaml) chooses between it and the eager Python loop (engine/layer_path.install_loop).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path

import torch

from del_bench.models.loading import cache_root

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("fused_layers.cpp")


class FusedUnavailable(RuntimeError):
    """The fused loop cannot serve this model on this machine (the message says why)."""


def build_dir() -> Path:
    """Where the build lives: beside the model cache (DEL_BENCH_CACHE), one per torch version and per version of the
    C++ source, so checkouts of different sources on one machine (a branch, a test's mutant copy) never rebuild over
    each other's module — they did, and a process could load another checkout's build (wrong arity, wrong bits)."""
    source = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
    return cache_root() / "torch_extensions" / f"torch-{torch.__version__}" / source


@contextmanager
def build_lock(directory: Path) -> Iterator[None]:
    """Hold the build directory for one load. torch's own lock (the file `lock`, made by FileBaton while it checks or
    builds, ~1 s or ~25 s) is a bare file: a process killed while holding it leaves it, and every later load waits on
    it forever — CI hung so, started minutes after a session's runs were killed. This lock is the kernel's (flock): it
    goes with its holder, so once we hold it no live process of ours is loading here, and a `lock` still there was
    left by a killed one and is removed."""
    with open(directory / "build.flock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # waits only for a live load (it ends, or dies and releases)
        try:
            left = directory / "lock"
            if left.exists():
                log.warning("removing %s, left by a build that was killed", left)
                left.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)


@cache
def extension():
    """The compiled module: the first call on a machine compiles for ~25 s (torch.utils.cpp_extension, which rebuilds
    when the source changes), later ones load it in < 1 s."""
    from torch.utils.cpp_extension import load

    directory = build_dir()
    directory.mkdir(parents=True, exist_ok=True)
    if not put_ninja_on_path():
        raise FusedUnavailable("ninja is not installed (`pip install ninja`: torch.utils.cpp_extension builds with it)")
    try:
        with build_lock(directory):
            try:  # OpenMP: the panels' products (at::parallel_for) on torch's threads
                return load(name="del_bench_fused_layers", sources=[str(SOURCE)], extra_cflags=["-O3", "-fopenmp"],
                            extra_ldflags=["-fopenmp"], build_directory=str(directory), verbose=False)
            except Exception:  # a compiler without OpenMP (Apple's clang): the same code, one thread
                return load(name="del_bench_fused_layers", sources=[str(SOURCE)], extra_cflags=["-O3"],
                            build_directory=str(directory), verbose=False)
    except Exception as err:  # no compiler, no ninja, a header mismatch: all mean "use eager"
        raise FusedUnavailable(f"building {SOURCE.name} failed ({type(err).__name__}: {err})") from err


def available() -> bool:
    """Whether the extension builds (or loads) here."""
    try:
        extension()
    except FusedUnavailable:
        return False
    return True


def put_ninja_on_path() -> bool:
    """torch.utils.cpp_extension runs `ninja` from PATH, but the pip package (a dependency) puts it beside the
    interpreter, which is not on PATH when .venv/bin/python is run without activating the venv: add that directory
    (or the package's own BIN_DIR) to this process's PATH. False when no ninja is found anywhere."""
    if shutil.which("ninja"):
        return True
    candidates = [str(Path(sys.executable).parent)]
    try:
        import ninja

        candidates.insert(0, ninja.BIN_DIR)
    except (ImportError, AttributeError):
        pass
    for directory in candidates:
        if shutil.which("ninja", path=directory):
            os.environ["PATH"] = os.pathsep.join([directory, os.environ.get("PATH", "")])
            return True
    return False


ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # the MLP activations fused_layers.cpp's mlp_sublayer computes


def unsupported(stack) -> str | None:
    """Why the fused loop cannot run this stack's layers (None: it can). Every variation families.py describes is in
    the C++ loop (LayerStack._fused_family_args passes it); check() still holds its bits to eager's at load."""
    if stack.math.activation not in ACTIVATIONS:
        return (f"the {stack.math.family.name} model's MLP activation {stack.math.activation!r} is not in the C++ loop "
                f"(it computes {', '.join(ACTIVATIONS)})")
    if len({lay.device for lay in stack.layers}) > 1:
        return "the layers span several devices (device_map): the loop moves no tensor between them"
    return None


def built_for(stack):
    """The extension, built (or loaded) and checked against the eager loop on this stack's own weights: FusedUnavailable
    where it cannot serve the model here (engine/layer_path.install_loop decides what to do then)."""
    reason = unsupported(stack)
    if reason:
        raise FusedUnavailable(reason)
    ext = extension()
    try:
        mismatch = check(stack, ext)
    except RuntimeError as err:  # e.g. a stale build of other code, loaded after a failed rebuild
        raise FusedUnavailable(f"the fused loop failed on this model ({err})") from err
    if mismatch:
        raise FusedUnavailable(mismatch)
    return ext


@torch.inference_mode()
def check(stack, ext, prompt: int = 5) -> str | None:
    """Run a few random tokens through every layer both ways — a batch at position 0 (prefill, verification) and
    then one token (drafting, Vanilla), collecting every layer's output — on a scratch cache. None when every output
    and every cache entry is the same bits; else what differed."""
    ids = torch.randint(0, stack.vocab_size, (1, prompt + 1), generator=torch.Generator().manual_seed(0))
    results = []
    try:
        for use in (None, ext):
            stack.fused = use
            cache = stack.new_cache(prompt + 1)
            outs: list[torch.Tensor] = []
            stack.forward_layers(stack.embed(ids[:, :prompt]), 0, stack.num_layers, 0, cache, collect=outs)
            stack.forward_layers(stack.embed(ids[:, prompt:]), 0, stack.num_layers, prompt, cache, collect=outs)
            results.append((outs, cache))
    finally:
        stack.fused = None  # the caller installs the loop it chooses
    (eager, eager_cache), (fused, fused_cache) = results
    for name, a, b in (("layer outputs", eager, fused), ("cached keys", eager_cache.k, fused_cache.k),
                       ("cached values", eager_cache.v, fused_cache.v)):
        if not all(torch.equal(x, y) for x, y in zip(a, b)):
            return f"the fused loop's {name} differ from the eager loop's on this machine"
    return None
