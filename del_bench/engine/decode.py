"""Decoding one prompt at a time: the Engine — a row's engine (engine/row.py) whose `generate` runs it as a batch of one
(engine/batch.py), so a single prompt goes through the very round driver a batch of B does.

    gen = Engine(stack, Sampling(), eos_ids).generate(prompt_ids, method, max_new_tokens, seed)

The loop, in brief (docs/design.md §6.2): prefill, then rounds — plan → draft → verify → accept → observe — each
round's tensor work done by the batch for all its rows (the draft shapes: engine/early_exit.py, engine/skipping.py,
engine/layer_parallel.py), each row's host part by its RowEngine (engine/row.py, engine/acceptance.py), and a Round
recorded per row and round (engine/rounds.py)."""

from __future__ import annotations

from del_bench.engine.batch import Batch
from del_bench.engine.rounds import Generation, Round  # noqa: F401 (part of this module's API)
from del_bench.engine.row import Decoding, Request, RoundPlan, RowEngine  # noqa: F401 (part of this module's API)
from del_bench.engine.sampling import Draws
from del_bench.engine.steps import Draft, Verified  # noqa: F401 (part of this module's API)
from del_bench.methods.base import Method


class Engine(RowEngine):
    """A RowEngine that decodes one prompt at a time: `generate` runs it as its batch of one (`alone`)."""

    _alone: Batch | None = None

    def generate(self, prompt_ids: list[int], method: Method, max_new_tokens: int, seed: int,
                 draws: Draws | None = None) -> Generation:
        """Decode up to max_new_tokens (never more) or through the first EOS, timed end to end. draws: where the
        random draws come from (tests enumerate them); default a torch.Generator seeded by seed."""
        out: list[Generation] = []

        def job(slot, _):
            out.append((yield Request(prompt_ids, method, max_new_tokens, seed, draws)))

        self.alone().run([None], job)
        return out[0]

    def alone(self, cache_len: int = 1024) -> Batch:
        """Its batch of one, made at the first call and again when its path changes; its cache grows to what a request
        needs."""
        if self._alone is None or self._alone.path is not self.path:
            self._alone = Batch.of(self, cache_len)
        return self._alone
