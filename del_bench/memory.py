"""Peak memory of decoding, per sample (the paper's Table 5: maximum allocated GPU memory during inference).

CUDA: torch.cuda.max_memory_allocated after torch.cuda.reset_peak_memory_stats, summed over the visible GPUs
(a sharded model spreads its weights and KV cache over them) — weights, KV cache, activations and whatever a
method allocates (DEL's shadow logits), as in the paper.

CPU: there is no allocator counter, so we use the process's peak resident set size (VmHWM in
/proc/self/status) after resetting it to the current RSS by writing "5" to /proc/self/clear_refs (Linux ≥ 4.0)
— the same "reset, decode, read the high-water mark" as on CUDA. It counts everything the process holds
(weights, KV cache, activations, the Python/torch runtime), so compare methods by their difference, as the
paper's overhead column does. Where the reset is impossible, ru_maxrss (the lifetime peak) is reported and
`memory_measure` says so.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import resource
import sys
from pathlib import Path

import torch

CUDA_MEASURE = "cuda max_memory_allocated during decoding, summed over GPUs (reset before each sample)"
RSS_MEASURE = "cpu peak RSS (VmHWM) of the process during decoding (reset via /proc/self/clear_refs before each sample)"
LIFETIME_MEASURE = "cpu peak RSS of the process since it started (ru_maxrss; no reset available: an upper bound)"


def _cuda(device: str) -> bool:
    return str(device).startswith("cuda") and torch.cuda.is_available()


def _reset_rss_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _vm_hwm() -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return None


class PeakMemory:
    """`with PeakMemory(device) as peak: …decode…` then `peak.bytes` and `peak.measure`."""

    def __init__(self, device: str):
        self.device = device
        self.bytes: int | None = None
        self.measure = ""

    def __enter__(self) -> "PeakMemory":
        if _cuda(self.device):
            for i in range(torch.cuda.device_count()):
                torch.cuda.reset_peak_memory_stats(i)
            self.measure = CUDA_MEASURE
        else:
            self.measure = RSS_MEASURE if _reset_rss_peak() and _vm_hwm() is not None else LIFETIME_MEASURE
        return self

    def __exit__(self, *exc) -> None:
        self.bytes = self.read()

    def read(self) -> int | None:
        """The peak since __enter__ (its reset), read now."""
        if _cuda(self.device):
            return sum(torch.cuda.max_memory_allocated(i) for i in range(torch.cuda.device_count()))
        if self.measure == RSS_MEASURE:
            return _vm_hwm()
        # ru_maxrss is in kB on Linux, bytes on macOS
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)

    def so_far(self) -> "BatchPeak":
        """For one row of a batch (engine/batch.py): a context whose bytes are this peak's at its exit — the whole
        batch's since it began (one reset for the batch: a reset per row would cut its neighbours' peaks short)."""
        return BatchPeak(self)


class BatchPeak:
    """PeakMemory.so_far: `with …as peak:` then peak.bytes, peak.measure, as PeakMemory's."""

    def __init__(self, batch: PeakMemory):
        self.batch, self.bytes = batch, None
        self.measure = f"{batch.measure}; batched: the batch's peak from its start to the row's end"

    def __enter__(self) -> "BatchPeak":
        return self

    def __exit__(self, *exc) -> None:
        self.bytes = self.batch.read()


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def rss_follows_live_memory(threshold: int = 1 << 16) -> bool:
    """Make the CPU RSS peak follow live memory (for memory measurements; glibc only, else False): every block of
    ≥ `threshold` bytes (a tensor of 16k float32 or more) gets its own mmap and goes back to the OS when freed.
    By default glibc raises this threshold as big blocks are freed and serves later ones from its heap, which it
    keeps: a sample's peak then depends on what ran before it. Process-wide; costs a syscall per big tensor."""
    name = ctypes.util.find_library("c")
    try:
        return bool(name) and ctypes.CDLL(name).mallopt(M_MMAP_THRESHOLD, threshold) == 1
    except (OSError, AttributeError):
        return False


def model_bytes(model) -> int:
    """Bytes of the model's parameters and buffers, each storage counted once (tied weights, fused views)."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        storage = t.untyped_storage()
        key = (storage.data_ptr(), t.device)
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def cache_bytes(cache) -> int:
    """Bytes preallocated by the engine's KV cache (keys and values of every layer)."""
    if cache is None:
        return 0
    return sum(t.numel() * t.element_size() for t in [*cache.k, *cache.v])
