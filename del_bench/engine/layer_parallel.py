"""AdaDecode's schedule (adaptive layer parallelism; Wei et al., 2025, Algorithm 1): the engine's step for methods
whose draft shape is "layer_parallel" (del_bench/methods/adadecode.py), for every row of a batch at once. Not
draft/verify rounds: each step is a walk up the layers, all rows' walks together — layer by layer one batched pass of
every row still walking (each with its own positions and width), at a head layer one product of their exit heads
and one read of their top probabilities — and each row records its own Round.

Each step walks the newest token t (position n−1) up the layers. Every layer i owes work for the positions
[cache.lengths[i], n−1]: tokens that exited early stopped there and their deeper layers were deferred. At layer i
the owed positions that t has not yet picked up join t's batch (their stored state is the output of layer i−1),
so deferred layers run batched with the next token that reaches them and every KV entry is exact.
- At a head layer ℓ < L (and fewer than `max_outstanding` early predictions unverified), the exit head
  (`LayerStack.exit_logits`: the layer's adapter, or the own head) gives the next token's distribution q; if its
  top probability exceeds γ the next token is drawn from q (greedy: its argmax) and emitted at once, the batch's
  states are stored, and the step ends. The top probability does not depend on the drawn token, so the
  decision to exit keeps rejection sampling exact (for γ ≥ ½ it is the paper's "p(t) > γ" whenever it exits).
- At layer L every position of the batch is final: each early prediction (the token after a deferred position
  p) is checked against the final distribution at p — greedy: equal argmax; sampling: accept with
  min(1, p/q), else draw from norm(max(0, p − q)) — in order; at the first rejection the token is replaced,
  every later token is dropped and every layer's cache is cut back to the kept positions (KVCache.crop). If all
  are kept, the next token comes from the final distribution at t's position.
- Generation ends only with nothing unverified (Decoding.owed): when the last emitted token is EOS, meets the stop
  condition or fills max_new_tokens while early predictions are outstanding, a flush step runs the deferred positions
  through their remaining layers (no new token) and verifies them; a rejection there resumes decoding.
Accounting: a step's loaded_layers = the layers it ran (one per layer invocation, whatever the batch: the
paper's cost unit, so eTPL compares with d·E + L rounds); head_calls = exit-head rows + verification rows;
adapter_rows = exit-head rows through an adapter. Records per step (rounds.jsonl): `emit_layer` (the layer whose
head produced the token this step emitted; L = full depth), `token_index` (its index in the output),
`verified` ([[token_index, layer, kept], …] for the early predictions checked this step), `dropped` (later
tokens removed by a rejection), `outstanding` (unverified early predictions after the step).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from del_bench.engine.rounds import Round
from del_bench.engine.sampling import accepts, choose, residual
from del_bench.engine.steps import DraftShape
from del_bench.models.layer_math import cat_on
from del_bench.numerics import widened
from del_bench.transfer import charged, to_list


@dataclass
class Deferred:
    """Per prompt: the stored states of deferred positions and what verification needs about their successors."""

    state: dict[int, torch.Tensor] = field(default_factory=dict)  # position → [1, 1, D] its last layer's output
    q: dict[int, torch.Tensor | None] = field(default_factory=dict)  # p → the warped head distribution that drew p + 1
    layer: dict[int, int] = field(default_factory=dict)  # position p → the head layer that predicted the token at p + 1

    def clear(self) -> None:
        self.state.clear()
        self.q.clear()
        self.layer.clear()


class Walk:
    """One row's step: its batch of positions [start, end] (h: their states after the layers run so far), walking up
    the layers until it exits at a head or reaches the last layer."""

    def __init__(self, slot, t0: float):
        self.slot, self.t0 = slot, t0
        run, L = slot.run, slot.engine.stack.num_layers
        if run.shape_state is None:
            run.shape_state = Deferred()
        self.deferred: Deferred = run.shape_state
        self.n = run.n  # the sequence length; the pending token sits at n − 1
        self.before = len(run.gen.output_ids)
        self.outstanding = (self.n - 1) - run.cache.lengths[L - 1]  # deferred positions: unverified predictions
        # flush: the last token is final (EOS, stop, budget) and needs no pass; only the deferred positions run
        self.flush = run.gen.stopped or len(run.gen.output_ids) >= run.max_new_tokens
        self.end = self.n - 2 if self.flush else self.n - 1  # last position of this step's batch
        self.h = None if self.flush else slot.engine.stack.embed(slot.engine.ids([run.gen.output_ids[-1]]))
        self.start = self.end + 1 if self.flush else self.n - 1
        self.can_exit = not self.flush and self.outstanding < run.method.max_outstanding
        self.loaded = self.head_rows = self.adapter_rows = 0
        self.done = False

    def join(self, i: int) -> bool:
        """Deferred positions whose next layer is i join the batch → whether the row runs layer i."""
        st, cache = self.slot.engine.stack, self.slot.run.cache
        owed = cache.lengths[i]
        if owed < self.start:  # [1, start − owed, D], on layer i's device (device_map: a state may live elsewhere)
            picked = cat_on([self.deferred.state[p] for p in range(owed, self.start)], st.layers[i].device, dim=1)
            self.h = picked if self.h is None else cat_on([picked, self.h], st.layers[i].device, dim=1)
            self.start = owed
        return self.h is not None

    def exit(self, layer: int, logits: torch.Tensor) -> None:
        """The exit head at `layer` was confident: the next token is drawn from it and emitted, t's deeper layers
        deferred, the step ends."""
        engine, run = self.slot.engine, self.slot.run
        token, q = choose(logits, engine.sampling, run.rng)
        for p in range(self.start, self.end + 1):
            self.deferred.state[p] = self.h[:, p - self.start : p - self.start + 1]
        self.deferred.q[self.end], self.deferred.layer[self.end] = q, layer
        _emit(engine, run.gen, token)
        run.owed = self.outstanding + 1
        engine.append_round(run.gen, Round(
            round=len(run.gen.rounds), exit_layer=layer, budget=0, drafted=1, accepted=0, emitted=1,
            loaded_layers=self.loaded, head_calls=self.head_rows, draft_s=time.perf_counter() - self.t0,
            adapter_rows=self.adapter_rows,
            trace={"emit_layer": layer, "token_index": self.before, "verified": [], "dropped": 0,
                   "outstanding": self.outstanding + 1}))
        self.done = True

    def verify(self) -> None:
        """Layer L: every position start..end is final → the early predictions verified in order (greedy: equal
        argmax; sampling: min(1, p/q), else a draw from the residual); at the first rejection the token is replaced,
        every later one dropped and every layer's cache cut back."""
        engine, run = self.slot.engine, self.slot.run
        st, L, gen = engine.stack, engine.stack.num_layers, run.gen
        t_verify = time.perf_counter()
        hn = st.norm(self.h)  # [1, end − start + 1, D]
        verified, token_index, dropped = [], None, 0
        for p in range(self.start, self.end + 1):
            row = st.head(hn[:, p - self.start : p - self.start + 1])[0, 0]  # [V] the final distribution at p
            self.head_rows += 1
            index = p + 1 - run.prompt_len  # output index of the token p predicts
            if index < len(gen.output_ids):  # an early prediction: keep it or replace it
                kept, replacement = _verify(gen.output_ids[index], row, self.deferred.q.get(p), engine.sampling,
                                            run.rng)
                engine.record_gap(gen, index, row)  # kept or replaced, token `index` is final now, chosen from row
                verified.append([index, self.deferred.layer.get(p), kept])
                if not kept:
                    dropped = len(gen.output_ids) - index - 1  # the tokens after the rejected one
                    del gen.output_ids[index:]
                    run.cache.crop(p + 1)  # positions > p are dropped at every layer
                    _emit(engine, gen, replacement)
                    token_index = index
                    break
            else:  # p = n − 1, t's own position: the next token at full depth
                token, _ = choose(row, engine.sampling, run.rng)
                _emit(engine, gen, token)
                engine.record_gap(gen, index, row)
                token_index = index
        self.deferred.clear()  # every deferred position is verified now (or dropped)
        run.owed = 0
        t_end = time.perf_counter()
        engine.append_round(gen, Round(
            round=len(gen.rounds), exit_layer=None, budget=0, drafted=0, accepted=sum(1 for v in verified if v[2]),
            emitted=len(gen.output_ids) - self.before, loaded_layers=self.loaded, head_calls=self.head_rows,
            draft_s=t_verify - self.t0, verify_s=t_end - t_verify, adapter_rows=self.adapter_rows,
            trace={"emit_layer": L if token_index is not None else None, "token_index": token_index,
                   "verified": verified, "dropped": dropped, "outstanding": 0}))
        self.done = True


class LayerParallel(DraftShape):
    name = "layer_parallel"
    rounds = False  # its step replaces a round's draft, verify, acceptance and records (DraftShape.step)

    def step(self, batch, slots: list) -> None:
        """One step of every row: their walks up the layers together (the module docstring)."""
        t0 = time.perf_counter()
        walks = [Walk(s, t0) for s in slots]
        L = batch.stack.num_layers
        for i in range(L):
            walking = [w for w in walks if not w.done and w.join(i)]
            if not walking:
                continue
            out, _ = batch.step({w.slot: batch.passing(w.h, w.start, i, i + 1) for w in walking})
            for w in walking:
                w.h = out[w.slot]  # positions start..end, [1, end − start + 1, D]
                w.loaded += 1
            layer = i + 1
            heads = [w for w in walking if w.can_exit and layer < L and layer in w.slot.method.head_layers]
            if heads:
                self._heads(batch, heads, layer)
        for w in walks:
            if not w.done:
                with charged([w.slot.ledger]):
                    w.verify()

    @staticmethod
    def _heads(batch, walks: list[Walk], layer: int) -> None:
        """The exit head at `layer` over every walking row's newest position in one product, their top probabilities
        in one read; a row above its method's γ exits (emits, defers t's deeper layers)."""
        slots = [w.slot for w in walks]
        logits = batch.head(slots, [w.h[:, -1:] for w in walks], [layer] * len(walks))  # [V] each
        probs = [w.slot.engine.sampling.probs(row) if w.slot.engine.sampling.do_sample else widened(row).softmax(-1)
                 for w, row in zip(walks, logits)]
        with charged([w.slot.ledger for w in walks]):
            tops = to_list(torch.stack([p.max().to(probs[0].dtype) for p in probs]))
        for w, row, top in zip(walks, logits, tops):
            w.head_rows += 1
            w.adapter_rows += batch.stack.has_adapter(layer)
            if top > w.slot.method.gamma:  # emit the next token here; defer t's deeper layers
                with charged([w.slot.ledger]):
                    w.exit(layer, row)


def _emit(engine, gen, token: int) -> None:
    gen.output_ids.append(token)
    gen.stopped = token in engine.eos_ids or (engine.stop is not None and engine.stop(gen.output_ids))


def _verify(token: int, row: torch.Tensor, q: torch.Tensor | None, sampling, rng) -> tuple[bool, int]:
    """Greedy: kept iff the final argmax equals it. Sampling: kept with prob min(1, p(x)/q(x)); else a draw
    from norm(max(0, p − q)) (Leviathan et al.). → (kept, replacement token when not kept)."""
    if not sampling.do_sample:
        target = to_list(row.argmax())
        return target == token, target
    p = sampling.probs(row)
    q = q.to(p.dtype)
    if accepts(token, q, p, rng):
        return True, token
    return False, rng.categorical(residual(p, q))
