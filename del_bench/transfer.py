"""The engine's host ↔ device transfers: every value decoding needs on the host (a token to emit, a confidence to stop
on, a round's accepted count, a method's statistics) comes through here, one transfer a call, counted — and so does
every token the host hands the device (a prompt, a token drafted on the host).

On a GPU each read waits for the queue: the kernels queued before it drain while the host idles, and nothing around
it can be captured as a CUDA graph. So the engine batches what a round needs into few reads (greedy early exit: the
round's drafts, targets and, in half precision, their top-2 logits in one), and `Round.host_syncs` reports how many a
round made — held in tests against an independent counter of the tensor reads themselves (del_bench/bench/syncs.py)."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import numpy as np
import torch

# reads so far (per thread: a bench may decode in a thread of its own); a row's Round.host_syncs counts those its
# Ledger was charged with
_counts = threading.local()


class Ledger:
    """One row's transfers in a batch (engine/batch.py; a batch of one too): every transfer made
    while the ledger is charged (`charged`) counts in it too — a batch's one read a round counts once in each row
    whose values it carried, so a row's Round.host_syncs are the transfers it took part in."""

    def __init__(self):
        self.count = 0
        self.share = 0.0  # Σ over the transfers it took part in of 1 ÷ the rows each carried: the rows' shares sum to
        # the batch's transfers


def reads() -> int:
    """How many device → host reads this thread has made so far (a round's count: the difference around it)."""
    return getattr(_counts, "reads", 0)


@contextmanager
def charged(ledgers: Iterable[Ledger]) -> Iterator[None]:
    """Transfers inside the block also count in each of these ledgers (the rows they carry values of)."""
    before = getattr(_counts, "ledgers", ())
    _counts.ledgers = (*before, *ledgers)
    try:
        yield
    finally:
        _counts.ledgers = before


def _count() -> None:
    _counts.reads = reads() + 1
    ledgers = getattr(_counts, "ledgers", ())
    for ledger in ledgers:
        ledger.count += 1
        ledger.share += 1 / len(ledgers)


def to_list(values: torch.Tensor) -> list:
    """values (any device) → a Python list (a 0-d tensor → a scalar): one counted transfer."""
    _count()
    return values.tolist()


def to_device(values: list, device: torch.device) -> torch.Tensor:
    """Host values (token ids) → a long tensor on device: one counted transfer (a blocking copy from pageable host
    memory waits for the queue on CUDA, as a read does)."""
    _count()
    return torch.tensor(values, dtype=torch.long, device=device)


def to_numpy(values: torch.Tensor) -> np.ndarray:
    """values (any device) → a NumPy array on the host: one counted transfer."""
    _count()
    return values.cpu().numpy()


def upload(values: list, device: torch.device) -> torch.Tensor:
    """A batched step's host-made inputs (positions, which rows run which layers: ints) → a long tensor on device,
    without a sync: on CUDA copied from pinned memory, asynchronously (the copy queues behind the steps before it;
    the allocator keeps the pinned block until it ran), on a CPU the host tensor itself. Not counted: nothing waits.
    What the host decided and the device must know each step travels this way, once a step (engine/batch.py)."""
    host = torch.tensor(values, dtype=torch.long)
    if device.type != "cuda":
        return host if device.type == "cpu" else host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
