"""The decode loop: prefill, then rounds of draft (layers 1..E + head) and verify (full depth).

Verification reuses the early layers' KV from drafting: only the last draft token goes through layers
1..E; the layer-E hidden states of all d+1 positions (the "exit query cache") then go through layers
E+1..L in one batch. A round therefore loads d·E + L layers (paper §4.1); the head runs once per draft
and once per verified position up to the first rejection. Vanilla is the round with d = 0 and no split.
The engine owns the KV cache, RNG, accounting and timing; methods only decide E, the budget and when to
stop drafting.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace

import torch

from del_bench.engine.sampling import Sampling, accept_greedy, accept_sampling, choose
from del_bench.methods.base import Method, RoundEvidence, Shadow
from del_bench.models.layer_stack import KVCache, LayerStack, synchronize


@dataclass
class Round:
    """One line of rounds.jsonl. Round 0 is the prefill (it emits the first token)."""

    round: int
    exit_layer: int | None
    budget: int  # the draft budget the method asked for, after capping by tokens left
    drafted: int
    accepted: int
    emitted: int
    loaded_layers: int  # drafted·E + L
    head_calls: int  # LM-head rows: draft candidates (incl. a dropped one) + verify rows up to the rejection
    draft_s: float = 0.0
    verify_s: float = 0.0
    policy_s: float = 0.0  # the method's own time: plan, keep_drafting, observe, and shadow tokens
    trace: dict = field(default_factory=dict)  # the method's per-round fields (Plan.trace)

    def as_dict(self) -> dict:
        row = asdict(self)
        trace = row.pop("trace")  # the method's fields become columns of their own
        return {**row, **trace}


@dataclass
class Generation:
    output_ids: list[int]
    rounds: list[Round] = field(default_factory=list)
    wall_s: float = 0.0
    stopped: bool = False  # ended by EOS or a stop condition (not by max_new_tokens)

    @property
    def loaded_layers(self) -> int:
        return sum(r.loaded_layers for r in self.rounds)

    @property
    def head_calls(self) -> int:
        return sum(r.head_calls for r in self.rounds)

    @property
    def drafted(self) -> int:
        return sum(r.drafted for r in self.rounds)

    @property
    def accepted(self) -> int:
        return sum(r.accepted for r in self.rounds)


# rounds whose shadow scoring a method may defer (see Method.can_defer) before the engine scores them anyway
MAX_DEFERRED = 16


class Engine:
    def __init__(self, stack: LayerStack, sampling: Sampling, eos_ids: set[int], stop=None):
        """stop: optional callable(output_ids) → True to end generation after the latest token
        (per-task stop strings); checked token by token, so no token after the stop is kept."""
        self.stack = stack
        self.sampling = sampling
        self.eos_ids = set(eos_ids)
        self.stop = stop
        self.device = stack.embed_weight.device
        self._cache: KVCache | None = None

    @property
    def cache(self) -> KVCache | None:
        """The preallocated KV cache, reused across prompts (None before the first generate): what memory reports."""
        return self._cache

    def _fresh_cache(self, max_len: int) -> KVCache:
        # One allocation reused across prompts; stale slots are overwritten before they are read.
        if self._cache is None or self._cache.max_len < max_len:
            self._cache = self.stack.new_cache(max(max_len, 1024))
        self._cache.crop(0)
        return self._cache

    def _ids(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor([ids], dtype=torch.long, device=self.device)

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], method: Method, max_new_tokens: int, seed: int) -> Generation:
        """Decode up to max_new_tokens (never more) or through the first EOS. Timed end to end."""
        L = self.stack.num_layers
        rng = torch.Generator(device=self.device).manual_seed(seed)
        cache = self._fresh_cache(len(prompt_ids) + max_new_tokens + 1)
        method.start(L)
        self._deferred: list[tuple[RoundEvidence, torch.Tensor, torch.Tensor]] = []  # unscored shadow windows
        gen = Generation(output_ids=[])
        synchronize(self.device)
        t0 = time.perf_counter()
        if max_new_tokens > 0:
            self._prefill(prompt_ids, cache, gen, method, rng)
            # seq length N = prompt + emitted; the last emitted token is not yet in any layer's cache
            while not self._done(gen, max_new_tokens):
                self._round(len(prompt_ids) + len(gen.output_ids), cache, gen, method, max_new_tokens, rng)
            if self._deferred:  # rounds still held back: scored inside the timed region, as without deferral
                t = time.perf_counter()
                self._observe_deferred(method)
                gen.rounds[-1].policy_s += time.perf_counter() - t
        synchronize(self.device)
        gen.wall_s = time.perf_counter() - t0
        return gen

    def _done(self, gen: Generation, max_new_tokens: int) -> bool:
        return gen.stopped or len(gen.output_ids) >= max_new_tokens

    def _prefill(self, prompt_ids, cache, gen, method: Method, rng) -> None:
        t = time.perf_counter()
        st, L = self.stack, self.stack.num_layers
        layers = [] if method.wants_shadow else None
        h = st.forward_layers(st.embed(self._ids(prompt_ids)), 0, L, 0, cache, collect=layers)  # [1, P, D]
        token, _ = choose(st.logits(h[:, -1:])[0, -1], self.sampling, rng)
        self._emit(gen, [token])
        t_policy = time.perf_counter()
        if layers is not None:
            w = min(method.prefill_window, len(prompt_ids))
            states = torch.cat(layers[: L - 1])[:, -w:]  # [L-1, w, D]
            target = st.logits(h[:, -w:])[0].argmax(-1)  # [w]
            method.observe_prefill(self._shadow_of(states, target, method.shadow_vocab))
        gen.rounds.append(Round(0, None, 0, 0, 0, 1, L, 1, verify_s=t_policy - t,
                                policy_s=time.perf_counter() - t_policy))

    def _round(self, n: int, cache, gen: Generation, method: Method, max_new_tokens: int, rng) -> None:
        st, L = self.stack, self.stack.num_layers
        t = time.perf_counter()
        plan = method.plan()
        left = max_new_tokens - len(gen.output_ids)
        # a round emits at most d + 1 tokens: capping d at left − 1 means we never overshoot
        budget = min(plan.max_draft, left - 1) if plan.exit_layer else 0
        E = plan.exit_layer if budget > 0 else L
        t_draft = time.perf_counter()
        policy_s = t_draft - t

        token, pos = gen.output_ids[-1], n - 1  # the pending token sits at position n − 1
        exit_states: list[torch.Tensor] = []  # layer-E hidden states, one [1, 1, D] per position
        drafts: list[int] = []
        draft_probs: list[torch.Tensor] = []
        candidates = 0  # draft heads applied (a dropped low-confidence candidate counts too)
        confidences: list[float] = []  # each candidate's, in order (the last may be the dropped one)
        keep_s = 0.0  # time inside method.keep_drafting: policy, not drafting
        stop = budget == 0
        early: list[list[torch.Tensor]] | None = [] if method.wants_shadow else None  # [position][layer]
        while True:
            # layers 1..E for the newest token; for the last one this is already part of verification
            layers = None if early is None else []
            exit_states.append(st.forward_layers(st.embed(self._ids([token])), 0, E, pos, cache, collect=layers))
            if early is not None:
                early.append(layers)
            pos += 1
            if stop or len(drafts) >= budget:
                break
            logits = st.logits(exit_states[-1])[0, -1]  # [V]
            candidates += 1
            candidate, q = choose(logits, self.sampling, rng)
            keep = True
            if method.wants_confidence:
                # the draft distribution's top probability: it does not depend on which token was
                # sampled, so stopping on it keeps speculative sampling exact
                confidence = float(q.max() if q is not None else logits.softmax(-1).max())
                confidences.append(confidence)
                tp = time.perf_counter()
                keep = method.keep_drafting(len(drafts), confidence)
                keep_s += time.perf_counter() - tp
                if not keep and method.drop_stopped_draft:  # Algorithm 1: break before appending
                    break
            drafts.append(candidate)
            draft_probs.append(q)
            token = candidate
            stop = not keep or candidate in self.eos_ids

        # with no draft budget the single pass through all L layers is the verification itself
        t_verify = t_draft if budget == 0 else time.perf_counter()
        d = len(drafts)
        # verify: all d + 1 positions through E+1..L at once, from the layer-E states of drafting
        late: list[torch.Tensor] | None = None if early is None else []  # [layer] → [1, d+1, D]
        h = st.norm(st.forward_layers(torch.cat(exit_states, dim=1), E, L, n - 1, cache, collect=late))
        rows: dict[int, int] = {}  # verified row → the verifier's greedy token there
        # the head runs row by row, only up to the first rejection (one row per round on average when
        # drafts rarely survive; a batched 5-row head costs ~4 single rows on a CPU)

        def target_row(i: int) -> torch.Tensor:
            logits = st.head(h[:, i : i + 1])[0, 0]  # [V]
            rows[i] = int(logits.argmax())
            return logits

        if self.sampling.do_sample:
            k, next_token = accept_sampling(drafts, draft_probs, target_row, self.sampling, rng)
        else:
            k, next_token = accept_greedy(drafts, target_row)
        emitted = self._emit(gen, drafts[:k] + [next_token])
        cache.crop(n + k)  # keep the pending token and the accepted drafts; the new pending is next_token
        t_observe = time.perf_counter()
        verify_s = t_observe - t_verify
        evidence = RoundEvidence(exit_layer=plan.exit_layer if d else None, drafted=d, accepted=k,
                                 budget_capped=budget < plan.max_draft)
        if early is None:
            method.observe(evidence)
        else:
            self._deferred.append((evidence, *self._window(early, late, E, k, rows, target_row)))
            windows = [states.shape[1] for _, states, _ in self._deferred]
            if len(windows) >= MAX_DEFERRED or not method.can_defer(windows):
                self._observe_deferred(method)
        policy_s += keep_s + time.perf_counter() - t_observe
        gen.rounds.append(Round(
            round=len(gen.rounds), exit_layer=E if d else None, budget=budget, drafted=d, accepted=k,
            emitted=emitted, loaded_layers=d * E + L, head_calls=candidates + len(rows),
            draft_s=t_verify - t_draft - keep_s, verify_s=verify_s, policy_s=policy_s,
            trace={**plan.trace, "draft_confidences": confidences} if confidences else plan.trace,
        ))

    def _observe_deferred(self, method: Method) -> None:
        """Score the shadow tokens of every deferred round in one head pass ([L-1, ΣW, D] rows: the head's
        weights are read once, not once per round) and hand the method its evidence round by round, in order."""
        evidence, states, targets = zip(*self._deferred)
        self._deferred.clear()
        shadow = self._shadow_of(torch.cat(states, dim=1), torch.cat(targets), method.shadow_vocab)
        start = 0
        for ev, window in zip(evidence, (t.shape[0] for t in targets)):
            part = slice(start, start + window)
            start += window
            method.observe(replace(ev, shadow=Shadow(shadow.tokens[:, part], shadow.confidence[:, part],
                                                     shadow.target[part], shadow.states[:, part])))

    def _window(self, early, late, E: int, k: int, rows: dict, target_row) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden states [L-1, W, D] and the full model's tokens [W] of the valid window, positions 0..k
        (k = accepted drafts: later positions were computed on a context the model did not keep). Layers
        1..E come from drafting, E+1..L−1 from the verification batch."""
        L, W = self.stack.num_layers, k + 1
        m = min(E, L - 1)  # layers 1..m come from drafting
        # early[i][j]: position i after layer j + 1, [1, 1, D] → [m, W, D]
        states = torch.cat([torch.cat(layers[:m]) for layers in early[:W]], dim=1)
        if m < L - 1:  # late[j]: layers E+1.., each [1, d+1, D] → [L-1-E, W, D]
            states = torch.cat([states, torch.cat(late[: L - 1 - m])[:, :W]])  # [L-1, W, D]
        for i in range(W):  # acceptance computed rows 0..k already; this only guards the invariant
            if i not in rows:
                target_row(i)
        target = torch.tensor([rows[i] for i in range(W)], device=states.device)
        return states, target

    def _shadow_of(self, states: torch.Tensor, target: torch.Tensor, vocab: int | None) -> Shadow:
        """states: [L-1, W, D] (layers 1..L−1), target: [W] the full model's tokens → Shadow."""
        n_layers, W, D = states.shape
        tokens, confidence = self.stack.shadow_tokens(states.reshape(-1, D), target.repeat(n_layers), vocab)
        return Shadow(tokens.view(n_layers, W), confidence.view(n_layers, W), target, states)

    def _emit(self, gen: Generation, tokens: list[int]) -> int:
        """Append tokens, stopping after an EOS or the stop condition. Returns how many were appended."""
        for i, tok in enumerate(tokens):
            gen.output_ids.append(tok)
            if tok in self.eos_ids or (self.stop is not None and self.stop(gen.output_ids)):
                gen.stopped = True
                return i + 1
        return len(tokens)
