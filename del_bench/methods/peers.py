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

    def decode(self, model, ids: torch.Tensor, max_new_tokens: int, eos_ids: set[int]) -> tuple[list[int], tuple]:
        """transformers' greedy output ids after `ids` [1, P], and the logits each was chosen from (a tuple of [1, V]
        float32 rows, one per token, where the peer keeps them: `keeps_logits`; else empty)."""
        eos = sorted(eos_ids)
        keep = self.keeps_logits(model)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
                             eos_token_id=eos or None, pad_token_id=eos[0] if eos else 0, **self.generate_kwargs(),
                             **({"output_logits": True, "return_dict_in_generate": True} if keep else {}))
        sequences = out.sequences if keep else out
        return sequences[0, ids.shape[1]:].tolist(), out.logits if keep else ()

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

    def decode(self, model, ids: torch.Tensor, max_new_tokens: int, eos_ids: set[int]) -> tuple[list[int], tuple]:
        from transformers import DynamicCache

        cache, out = DynamicCache(config=model.config), []
        while len(out) < max_new_tokens:
            logits = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[0, -1]
            out.append(int(logits.argmax()))
            if out[-1] in eos_ids:
                break
            ids = torch.tensor([[out[-1]]], device=ids.device)
        return out, ()


class Serial:
    """A peer's decoder as the runner drives its rows (runner.rows_of): one prompt at a time, a batch of one (its
    layer path: the stack's loop it would have run; a peer runs no graphs)."""

    size, slot, cache = 1, 0, None

    def __init__(self, decoder: "PeerDecoder", layer_path: str):
        self.decoder, self.path = decoder, SimpleNamespace(name=layer_path, graphs=None)
        self.engines = [decoder]

    def run(self, jobs, decode) -> dict:
        """Every job (a generator of Requests) run to its end, one generation at a time."""
        for job in jobs:
            requests = decode(self, job)
            try:
                request = next(requests)
                while True:
                    request = requests.send(self.decoder.generate(request.prompt_ids, request.method,
                                                                  request.max_new_tokens, request.seed))
            except StopIteration:
                pass
        return {}


class PeerDecoder:
    """The runner's engine for a peer row: `generate` as our Engine's, decoded by transformers."""

    cache = None  # no preallocated KV cache of ours (records' kv_cache_bytes: 0)

    def __init__(self, peer: Peer, model, eos_ids: set[int], stop):
        self.peer, self.model, self.eos_ids, self.stop = peer, model, set(eos_ids), stop
        self.device = model.lm_head.weight.device

    def serial(self, layer_path: str) -> Serial:
        return Serial(self, layer_path)

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], method, max_new_tokens: int, seed: int) -> PeerGeneration:
        ids = torch.tensor([prompt_ids], device=self.model.model.embed_tokens.weight.device)
        with counted(self.model) as calls:
            self.synchronize()
            t0 = time.perf_counter()
            out, logits = self.peer.decode(self.model, ids, max_new_tokens, self.eos_ids)
            self.synchronize()
            wall = time.perf_counter() - t0
        out = cut(out, self.eos_ids, self.stop)
        # read after the clock: each kept row's top-2 gap in ulps of the model's dtype (generate upcasts after the head)
        gaps = [gap_ulps(row[0], dtype=self.model.dtype) for row in logits[: len(out)]] if logits else None
        target_passes, passes = calls.layers[-1], calls.layers[0]
        drafted = passes - target_passes
        return PeerGeneration(out, wall, loaded_layers=sum(calls.layers), head_calls=calls.head_rows,
                              drafted=drafted, accepted=max(0, len(out) - target_passes) if drafted else 0,
                              top2_gap_ulps=gaps)
