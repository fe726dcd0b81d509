"""AdaDecode's schedule (adaptive layer parallelism; Wei et al., 2025, Algorithm 1): the engine step for
methods with `schedule = "layer_parallel"` (del_bench/methods/adadecode.py). Not draft/verify rounds.

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
- Generation ends only with nothing unverified: when the last emitted token is EOS, meets the stop condition or
  fills max_new_tokens while early predictions are outstanding, a flush step runs the deferred positions through
  their remaining layers (no new token) and verifies them; a rejection there resumes decoding.
Accounting: a step's loaded_layers = the layers it ran (one per layer invocation, whatever the batch: the
paper's cost unit, so eTPL compares with d·E + L rounds); head_calls = exit-head rows + verification rows;
adapter_rows = exit-head rows through an adapter. Records per step (rounds.jsonl): `emit_layer` (the layer whose
head produced the token this step emitted; L = full depth), `token_index` (its index in the output),
`verified` ([[token_index, layer, kept], …] for the early predictions checked this step), `dropped` (later
tokens removed by a rejection), `outstanding` (unverified early predictions after the step).
"""

from __future__ import annotations

import time

import torch

from del_bench.engine.rounds import Round
from del_bench.engine.sampling import accepts, choose, residual
from del_bench.models.layer_math import cat_on
from del_bench.numerics import widened
from del_bench.transfer import to_list


class _Deferred:
    """Per prompt: the stored states of deferred positions and what verification needs about their successors."""

    def __init__(self):
        self.state: dict[int, torch.Tensor] = {}  # position → [1, 1, D] its output of the last layer it ran
        self.q: dict[int, torch.Tensor | None] = {}  # position p → the warped head distribution that drew p + 1
        self.layer: dict[int, int] = {}  # position p → the head layer that predicted the token at p + 1

    def clear(self) -> None:
        self.state.clear()
        self.q.clear()
        self.layer.clear()


def decode(engine, prompt_len: int, cache, gen, method, max_new_tokens: int, rng) -> None:
    """After prefill (one token emitted): steps until the output is final (see the module docstring)."""
    deferred = _Deferred()
    L = engine.stack.num_layers
    while True:
        n = prompt_len + len(gen.output_ids)  # sequence length; the pending token sits at n − 1
        outstanding = (n - 1) - cache.lengths[L - 1]  # deferred positions = unverified early predictions
        if gen.stopped or len(gen.output_ids) >= max_new_tokens:
            if outstanding == 0:
                return
            _step(engine, prompt_len, cache, gen, method, rng, deferred, flush=True)
        else:
            _step(engine, prompt_len, cache, gen, method, rng, deferred, flush=False)


def _emit(engine, gen, token: int) -> None:
    gen.output_ids.append(token)
    gen.stopped = token in engine.eos_ids or (engine.stop is not None and engine.stop(gen.output_ids))


def _step(engine, prompt_len, cache, gen, method, rng, deferred: _Deferred, flush: bool) -> None:
    t0 = time.perf_counter()
    st, L, sampling = engine.stack, engine.stack.num_layers, engine.sampling
    n = prompt_len + len(gen.output_ids)
    before = len(gen.output_ids)
    outstanding = (n - 1) - cache.lengths[L - 1]
    # flush: the pending token is final (EOS, stop, budget) and needs no pass; only the deferred positions run
    end = n - 2 if flush else n - 1  # last position of this step's batch
    h, start = (None, end + 1) if flush else (st.embed(engine.ids([gen.output_ids[-1]])), n - 1)
    loaded = head_rows = adapter_rows = 0
    can_exit = not flush and outstanding < method.max_outstanding
    for i in range(L):
        owed = cache.lengths[i]
        if owed < start:  # deferred positions whose next layer is i join the batch: [1, start − owed, D]
            on = st.layers[i].device  # layer i runs where its weights live (device_map: a stored state may not)
            picked = cat_on([deferred.state[p] for p in range(owed, start)], on, dim=1)
            h = picked if h is None else cat_on([picked, h], on, dim=1)
            start = owed
        if h is None:  # flush: no position owes this layer yet
            continue
        h = engine.forward_layers(h, i, i + 1, start, cache)  # positions start..end, [1, end − start + 1, D]
        loaded += 1
        layer = i + 1
        if can_exit and layer < L and layer in method.head_layers:
            logits = st.exit_logits(h[:, -1:], layer)[0, -1]  # [V]
            head_rows += 1
            adapter_rows += st.has_adapter(layer)
            probs = sampling.probs(logits) if sampling.do_sample else widened(logits).softmax(-1)
            if to_list(probs.max()) > method.gamma:  # emit the next token here; defer t's deeper layers
                token, q = choose(logits, sampling, rng)
                for p in range(start, end + 1):
                    deferred.state[p] = h[:, p - start : p - start + 1]
                deferred.q[end], deferred.layer[end] = q, layer
                _emit(engine, gen, token)
                engine.append_round(gen, Round(
                    round=len(gen.rounds), exit_layer=layer, budget=0, drafted=1, accepted=0, emitted=1,
                    loaded_layers=loaded, head_calls=head_rows, draft_s=time.perf_counter() - t0,
                    adapter_rows=adapter_rows,
                    trace={"emit_layer": layer, "token_index": before, "verified": [], "dropped": 0,
                           "outstanding": outstanding + 1}))
                return
    # layer L: every position start..end is final → verify the early predictions in order
    t_verify = time.perf_counter()
    hn = st.norm(h)  # [1, end − start + 1, D]
    verified, token_index, dropped = [], None, 0
    for p in range(start, end + 1):
        row = st.head(hn[:, p - start : p - start + 1])[0, 0]  # [V] the final distribution at p
        head_rows += 1
        index = p + 1 - prompt_len  # output index of the token p predicts
        if index < len(gen.output_ids):  # an early prediction: keep it or replace it
            token = gen.output_ids[index]
            kept, replacement = _verify(token, row, deferred.q.get(p), sampling, rng)
            engine.record_gap(gen, index, row)  # kept or replaced, token `index` is final now, chosen from row
            verified.append([index, deferred.layer.get(p), kept])
            if not kept:
                dropped = len(gen.output_ids) - index - 1  # the tokens after the rejected one
                del gen.output_ids[index:]
                cache.crop(p + 1)  # positions > p are dropped at every layer
                _emit(engine, gen, replacement)
                token_index = index
                break
        else:  # p = n − 1, t's own position: the next token at full depth
            token, _ = choose(row, sampling, rng)
            _emit(engine, gen, token)
            engine.record_gap(gen, index, row)
            token_index = index
    deferred.clear()  # every deferred position is verified now (or dropped)
    t_end = time.perf_counter()
    kept = sum(1 for v in verified if v[2])
    engine.append_round(gen, Round(
        round=len(gen.rounds), exit_layer=None, budget=0, drafted=0, accepted=kept,
        emitted=len(gen.output_ids) - before, loaded_layers=loaded, head_calls=head_rows,
        draft_s=t_verify - t0, verify_s=t_end - t_verify, adapter_rows=adapter_rows,
        trace={"emit_layer": L if token_index is not None else None, "token_index": token_index,
               "verified": verified, "dropped": dropped, "outstanding": 0}))


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
