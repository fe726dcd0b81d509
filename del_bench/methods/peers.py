"""Peers as rows: transformers' own decoding, written as records like ours, so it pairs with our Vanilla.

A peer is a method config the bench composes in code (`peer_method`; no configs/method file: it is not a policy
for our engine), whose class says it decodes by itself (`Peer.decoder`): the runner then hands each prompt to the
peer's decoder instead of our Engine, and writes a SampleRecord per prompt as for any run (no rounds.jsonl lines:
transformers exposes no rounds). Its RunKey's method is the peer's (`hf_generate`, `hf_assistant_early_exit`,
`hf_forward_loop`), so `show` and the report list it beside our rows and pair it with our Vanilla
(RunKey.pairs_with), labelled as their classes say (family PEER: records.method_label marks them †) and a note
under a table.

What a peer record holds, counted where it runs (forward hooks on the decoder layers and the LM head, never
claimed): loaded_layers = decoder-layer calls (each call over any number of positions is one load, as in ours),
head_calls = LM-head rows, and for assistant_early_exit drafted = draft passes (calls of layer 1 that are not
calls of layer L: the draft runs layers 1..E < L) and accepted = emitted − target passes (each verification
emits its accepted drafts + 1). wall_s is the `generate` call, prefill included, tokenisation excluded (the
prompt ids are ours), synchronised on CUDA. Greedy only (sampling: a ConfigError). `generate` in half precision
also records each token's top-2 gap (top2_gap_ulps, as our runs do), read after its clock.

transformers decodes on the model object the row loaded — the one our LayerStack re-pointed at its storage (one
copy of the weights, as in bench gpu) — so the record's layer_path names the loop that storage was laid out for:
a peer pairs with the Vanilla of the same load. Outputs are cut after the first EOS and at a task's stop string,
as our engine stops (assisted generation may emit a few tokens past either in its last step).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from del_bench.errors import ConfigError
from del_bench.methods.base import PEER, Method
from del_bench.methods.ls import LSConfig
from del_bench.numerics import gap_ulps, is_half


def peer_method(name: str, **params) -> dict:
    """The method config of a peer row (what `row(..., method=…)` puts in place of a composed one)."""
    cls = {"hf_generate": "HFGenerate", "hf_assistant_early_exit": "HFAssistantEarlyExit",
           "hf_forward_loop": "HFForwardLoop"}[name]
    tag = name.replace("_", "-") + "".join(f"-{k[0].upper()}{v}" for k, v in params.items())
    return {"_target_": f"{__name__}.{cls}", "name": name, "tag": tag, **params}


@dataclass
class PeerGeneration:
    """What the runner reads of a Generation, for a peer's output (counted by hooks, no rounds)."""

    output_ids: list[int]
    wall_s: float
    loaded_layers: int
    head_calls: int
    drafted: int = 0
    accepted: int = 0
    rounds: list = field(default_factory=list)
    top2_gap_ulps: list | None = None
    ttft_s: float | None = None  # generate returns all its tokens at once: no first token's time


@dataclass
class Calls:
    layers: list[int]  # calls of each decoder layer
    head_rows: int = 0


@contextmanager
def counted(model):
    """Count decoder-layer calls and LM-head rows while transformers decodes (hooks removed after)."""
    layers = model.model.layers
    calls = Calls([0] * len(layers))

    def layer_hook(i):
        def hook(*_):
            calls.layers[i] += 1
        return hook

    def head_hook(_, __, logits):  # logits: [1, T, V], T = the rows the head ran on
        calls.head_rows += logits.shape[-2]

    handles = [layer.register_forward_hook(layer_hook(i)) for i, layer in enumerate(layers)]
    handles.append(model.lm_head.register_forward_hook(head_hook))
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()


def cut(output_ids: list[int], eos_ids: set[int], stop) -> list[int]:
    """The output as our engine ends it: through the first EOS, or the token that completes a stop string."""
    for i, tok in enumerate(output_ids):
        if tok in eos_ids or (stop is not None and stop(output_ids[: i + 1])):
            return output_ids[: i + 1]
    return output_ids


class Peer(Method):
    """A peer: transformers decodes greedily; no policy of ours runs."""

    name = "peer"
    family, order = PEER, 100  # after ours, in the tables and `show`

    def decoder(self, model, eos_ids: set[int], stop, sampling) -> PeerDecoder:
        if sampling.do_sample:
            raise ConfigError(f"peer {self.name} runs greedy decoding only (generation.do_sample=false)")
        return PeerDecoder(self, model, eos_ids, stop)

    batches = False  # whether decode takes several prompts at once (left-padded: HFGenerate)

    def decode(self, model, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int,
               eos_ids: set[int]) -> tuple[list[list[int]], tuple]:
        """transformers' greedy output ids after each row of `ids` [R, P] (left-padded where mask [R, P] is 0), and
        the logits each was chosen from (a tuple of [R, V] float32 rows, one per step, where the peer keeps them:
        `keeps_logits`; else empty)."""
        eos = sorted(eos_ids)
        keep = self.keeps_logits(model)
        out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                             eos_token_id=eos or None, pad_token_id=eos[0] if eos else 0, **self.generate_kwargs(),
                             **({"output_logits": True, "return_dict_in_generate": True} if keep else {}))
        sequences = out.sequences if keep else out
        return sequences[:, ids.shape[1]:].tolist(), out.logits if keep else ()

    def keeps_logits(self, model) -> bool:
        """Whether decode returns its logits: never, but for generate in half precision (HFGenerate)."""
        return False

    def generate_kwargs(self) -> dict:
        return {}

    def describe(self) -> dict:
        """The transformers version and what generate is asked beyond greedy decoding."""
        import transformers

        return {"transformers": transformers.__version__, **self.generate_kwargs()}


class HFGenerate(Peer):
    """`generate`, greedy. In half precision it also keeps the logits each token was chosen from (output_logits:
    the float32 row generate computes anyway, kept, not recomputed; V × 4 bytes a token in the peak memory), so its
    records carry top2_gap_ulps as our runs' do and a departure from it can be judged a near-tie or not
    (del_bench/numerics.py)."""

    name = "hf_generate"
    label, order = "HF generate", 100
    batches = True

    def keeps_logits(self, model) -> bool:
        return is_half(model.dtype)


class HFAssistantEarlyExit(Peer):
    """`generate(assistant_early_exit=E, num_assistant_tokens=γ)`: LayerSkip's self-speculation in transformers,
    confidence threshold 0 and a constant schedule, so it drafts exactly γ tokens a round, as LS(E, γ)."""

    name = "hf_assistant_early_exit"
    label, order = "HF assistant_early_exit", 102
    label_hyperparameters = (("exit_layer", "E"), ("gamma", "γ"))
    config = LSConfig  # LS's E and γ, as transformers takes them

    def __init__(self, exit_layer: int, gamma: int, **_):
        self.exit_layer, self.gamma = exit_layer, gamma

    def generate_kwargs(self) -> dict:
        return {"assistant_early_exit": self.exit_layer, "num_assistant_tokens": self.gamma,
                "assistant_confidence_threshold": 0.0, "num_assistant_tokens_schedule": "constant"}

    def describe(self) -> dict:  # E and γ under our names too: tables label it as LS, HF assistant_early_exit(E-γ)†
        return {"exit_layer": self.exit_layer, "gamma": self.gamma, **super().describe()}


class HFForwardLoop(Peer):
    """Greedy decoding with transformers' forward and its DynamicCache, no generate() machinery: what generate's
    per-call overhead costs."""

    name = "hf_forward_loop"
    label, order = "HF forward loop", 101

    def decode(self, model, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int,
               eos_ids: set[int]) -> tuple[list[list[int]], tuple]:
        from transformers import DynamicCache

        cache, out = DynamicCache(config=model.config), []
        while len(out) < max_new_tokens:
            logits = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[0, -1]
            out.append(int(logits.argmax()))
            if out[-1] in eos_ids:
                break
            ids = torch.tensor([[out[-1]]], device=ids.device)
        return [out], ()


class PeerRow:
    """A row of a peer's batch, as the runner reads a Batch's slot (runner.rows_of's decode_row): its slot, when its
    job began, and its shares of the batch's layer calls and head passes (each call ÷ the rows in it)."""

    def __init__(self, slot: int, start_s: float):
        self.slot, self.start_s = slot, start_s
        self.loaded_layers = self.idle_layers = self.head_passes = 0.0

    def tally(self) -> tuple[float, float]:
        """No host reads or rounds of ours: transformers decodes (records.host_reads: None)."""
        return 0.0, 0.0


class PeerBatch:
    """A peer's decoder as the runner drives its rows (runner.rows_of), B prompts a call: at B = 1 one prompt at a
    time; past it transformers' batched `generate` over up to B prompts left-padded (static batching, as `generate`
    batches: a call runs until its last row ends, finished rows padded; the next call takes the next B requests). Its
    layer path: the stack's loop its storage was laid out for; a peer runs no graphs."""

    cache = None

    def __init__(self, decoder: "PeerDecoder", size: int, layer_path: str):
        self.decoder, self.size, self.path = decoder, size, SimpleNamespace(name=layer_path, graphs=None)
        self.engines = [decoder]
        self._t0 = time.perf_counter()

    def elapsed(self) -> float:
        self.decoder.synchronize()
        return time.perf_counter() - self._t0

    def run(self, jobs, decode) -> dict:
        """Every job (a generator of Requests) run to its end, each call of `generate` over the requests of up to B
        jobs."""
        queue, waiting = iter(jobs), []  # waiting: (row, its job's generator, its request)
        self._t0 = time.perf_counter()

        def admit():
            free = sorted(set(range(self.size)) - {row.slot for row, _, _ in waiting})
            for slot in free:
                for job in queue:
                    row = PeerRow(slot, self.elapsed())
                    requests = decode(row, job)
                    request = next(requests, None)
                    if request is not None:
                        waiting.append((row, requests, request))
                        break

        admit()
        while waiting:
            gens = self.decoder.generate_rows([r for _, _, r in waiting], [row for row, _, _ in waiting])
            still = []
            for (row, requests, _), gen in zip(waiting, gens):
                try:
                    still.append((row, requests, requests.send(gen)))
                except StopIteration:
                    pass
            waiting[:] = still
            admit()
        return {}


class PeerDecoder:
    """The runner's engine for a peer row: `generate` as our Engine's, decoded by transformers."""

    cache = None  # no preallocated KV cache of ours (records' kv_cache_bytes: 0)

    def __init__(self, peer: Peer, model, eos_ids: set[int], stop):
        self.peer, self.model, self.eos_ids, self.stop = peer, model, set(eos_ids), stop
        self.device = model.lm_head.weight.device

    def rows(self, size: int, layer_path: str) -> PeerBatch:
        return PeerBatch(self, size, layer_path)
    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def generate(self, prompt_ids: list[int], method, max_new_tokens: int, seed: int) -> PeerGeneration:
        """One prompt's generation (a batch of one)."""
        return self.generate_rows([SimpleNamespace(prompt_ids=prompt_ids, max_new_tokens=max_new_tokens)])[0]

    @torch.inference_mode()
    def generate_rows(self, requests: list, rows: list[PeerRow] | None = None) -> list[PeerGeneration]:
        """One call of the peer's decode over every request's prompt, left-padded to the longest (max_new_tokens: the
        largest asked; each output cut to its own). Each generation's wall_s is the call's (its latency: every row
        waits for the call); its loaded_layers the layer calls it ran in, and each row's shares of the call's loads
        go to its PeerRow (idle: the layer calls after its output ended, run for padding)."""
        device = self.model.model.embed_tokens.weight.device
        width = max(len(r.prompt_ids) for r in requests)
        pad = min(self.eos_ids) if self.eos_ids else 0
        ids = torch.tensor([[pad] * (width - len(r.prompt_ids)) + list(r.prompt_ids) for r in requests], device=device)
        mask = torch.tensor([[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids) for r in requests],
                            device=device)  # [R, P]
        with counted(self.model) as calls:
            self.synchronize()
            t0 = time.perf_counter()
            outs, logits = self.peer.decode(self.model, ids, mask, max(r.max_new_tokens for r in requests),
                                            self.eos_ids)
            self.synchronize()
            wall = time.perf_counter() - t0
        target_passes, passes, loads = calls.layers[-1], calls.layers[0], sum(calls.layers)
        gens = []
        for i, (request, out) in enumerate(zip(requests, outs)):
            out = cut(out[: request.max_new_tokens], self.eos_ids, self.stop)
            # read after the clock: each kept row's top-2 gap in ulps of the model's dtype (generate upcasts after
            # the head)
            gaps = [gap_ulps(step[i], dtype=self.model.dtype) for step in logits[: len(out)]] if logits else None
            drafted = passes - target_passes
            gens.append(PeerGeneration(out, wall, loaded_layers=loads, head_calls=calls.head_rows, drafted=drafted,
                                       accepted=max(0, len(out) - target_passes) if drafted else 0,
                                       top2_gap_ulps=gaps))
            if rows is not None:
                row = rows[i]
                row.loaded_layers += loads / len(requests)
                row.head_passes += calls.head_rows / len(requests)
                row.idle_layers += max(0, target_passes - len(out)) * len(calls.layers)
        return gens
