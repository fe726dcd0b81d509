"""Synthetic early-exit models: random weights at a real model's shape, whose early exits agree with the last layer
as often as asked (`model=synthetic-llama2-7b`, `synthetic-llama3-8b`, `synthetic-smollm2`, `synthetic-testbed`).

No LayerSkip checkpoint can be downloaded here, a random model's early exits almost never agree with its last layer
(every self-speculative method drafts nothing), and the testbed is too small to cost what a real layer costs. A
synthetic model has the matrices of the shape it names, so a layer streams the bytes a real one does, and an
agreement profile that rises with depth, so every method pays, or not, as on a trained model.

How: layer i's writes into the residual stream (its attention's o_proj and its MLP's down_proj) are scaled by rⁱ.
With r < 1 each layer adds less than the one before, so what the layers after i still change shrinks with i, and
the greedy token read at layer i (the model's own head on its normed state) agrees with the last layer's more often
the deeper i is. r is calibrated when the model is built: bisection until the agreement at the model's default LS
exit layer (`default_exit_layer`) is `agreement` (default 0.8), measured as LS meets it — along the model's own
greedy continuations of random prompts (`calibration_prompts` × `calibration_tokens`), every position's exit token
against the last layer's. The achieved agreement at every layer, measured once more on the final weights, is kept
on the model (`model.synthetic`) and recorded in the run's setup; r is cached per shape, seed, agreement, dtype and
device type (~/.cache/del_bench/synthetic.json), so later builds skip the bisection and only measure.
"""

from __future__ import annotations

import json
import logging
import random
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from del_bench.errors import ConfigError

log = logging.getLogger(__name__)

SHAPES = {  # the matrix sizes of the checkpoints (their HF configs); "tiny": the suite's CPU smoke shape
    "llama2-7b": dict(layers=32, hidden=4096, heads=32, kv_heads=32, intermediate=11008, vocab=32000),
    "llama2-13b": dict(layers=40, hidden=5120, heads=40, kv_heads=40, intermediate=13824, vocab=32000),
    "llama3-8b": dict(layers=32, hidden=4096, heads=32, kv_heads=8, intermediate=14336, vocab=128256),
    "smollm2": dict(layers=30, hidden=576, heads=9, kv_heads=3, intermediate=1536, vocab=49152),
    "testbed": dict(layers=16, hidden=256, heads=8, kv_heads=4, intermediate=640, vocab=2048),
    "tiny": dict(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=128),
}
RATIO_RANGE = (0.05, 1.5)  # r's bisection bounds: r⁰ … r^(L−1) spans "only layer 1 matters" to "later layers grow"
BISECTION_STEPS = 12
CACHE_FILE = "synthetic.json"  # in the model cache (DEL_BENCH_CACHE): {shape, seed, agreement, …: r}


def random_llama(config, dtype: torch.dtype, device: torch.device | str, seed: int):
    """A LlamaForCausalLM of `config` with transformers' random initialisation, allocated and initialised on `device`
    in `dtype` (no copy anywhere else). The weights depend only on the seed, the device type and the transformers
    version: torch.manual_seed seeds every device's generator and the initialisation draws in module order."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # as from_pretrained(dtype=) builds: every parameter made in the dtype
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default_dtype)
    return model.eval()


def llama_config(shape: dict, **extra):
    """A LlamaConfig of a SHAPES entry (no EOS unless `extra` names one)."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
                       num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                       num_key_value_heads=shape["kv_heads"], max_position_embeddings=4096,
                       tie_word_embeddings=shape.get("tied", False),
                       **{"bos_token_id": None, "eos_token_id": None, "pad_token_id": 0, **extra})


def shape_of(cfg) -> dict:
    """The model config's shape: SHAPES[cfg.shape], any size overridden by the config's own keys."""
    if cfg.shape not in SHAPES:
        raise ConfigError(f"model.shape={cfg.shape!r} is not a shape; choose one of {', '.join(sorted(SHAPES))}")
    shape = dict(SHAPES[cfg.shape])
    names = {"num_layers": "layers", "hidden_size": "hidden", "num_heads": "heads", "num_kv_heads": "kv_heads",
             "intermediate_size": "intermediate", "vocab_size": "vocab"}
    shape.update({key: int(cfg[name]) for name, key in names.items() if cfg.get(name) is not None})
    return shape


def build(cfg, dtype: torch.dtype, tokenizer, cache: Path):
    """The synthetic model of `cfg` (source: synthetic) on cfg.device in `dtype`, calibrated (its r cached in the
    directory `cache`): → the model."""
    shape = shape_of(cfg)
    E, target = int(cfg.default_exit_layer), float(cfg.get("agreement", 0.8))
    if not 0 < target < 1:
        raise ConfigError(f"model.agreement={target}: an agreement is a fraction of tokens, in (0, 1)")
    if not 1 <= E < shape["layers"]:
        raise ConfigError(f"model.default_exit_layer={E}: an exit layer of a {shape['layers']}-layer model is in "
                          f"[1, {shape['layers'] - 1}]")
    device = torch.device(cfg.get("device") or "cpu")
    eos = getattr(tokenizer, "eos_token_id", None)
    t0 = time.perf_counter()
    model = random_llama(llama_config(shape, eos_token_id=eos), dtype, device, int(cfg.get("seed", 0)))
    built_s = time.perf_counter() - t0
    prompts = calibration_prompts(tokenizer, shape["vocab"], int(cfg.get("calibration_prompts", 8)), device)
    tokens = int(cfg.get("calibration_tokens", 32))
    key = f"{cfg.shape}:{shape}:seed{cfg.get('seed', 0)}:E{E}:{target}:{dtype}:{device.type}:{prompts.shape}:{tokens}"
    t0 = time.perf_counter()
    ratio = _cached(cache, key)
    if ratio is None:
        ratio = calibrate(model, E, target, prompts, tokens)
        _store(cache, key, ratio)
    scale_residual_writes(model, ratio)
    profile = agreement_by_layer(model, prompts, tokens)
    model.synthetic = {"shape": cfg.shape, "ratio": ratio, "target_agreement": target, "exit_layer": E,
                       "agreement_by_layer": [round(a, 4) for a in profile], "agreement": round(profile[E - 1], 4),
                       "build_s": round(built_s, 2), "calibration_s": round(time.perf_counter() - t0, 2)}
    log.info("synthetic %s: r = %.4f, agreement at layer %d %.3f (asked %.3f)", cfg.shape, ratio, E,
             profile[E - 1], target)
    return model


def random_text(rng: random.Random, chars: int) -> str:
    """Random printable ASCII: the prompts calibration and the benches give a synthetic model (the same kind, so the
    agreement asked is the agreement met)."""
    return "".join(chr(rng.randrange(33, 127)) for _ in range(chars))


def calibration_prompts(tokenizer, vocab: int, count: int, device, length: int = 16) -> torch.Tensor:
    """[count, length] ids of seeded random_text prompts, each cut to `length` tokens."""
    rng = random.Random(1234)
    rows = []
    while len(rows) < count:
        ids = tokenizer(random_text(rng, 4 * length), add_special_tokens=False)["input_ids"][:length]
        if len(ids) == length and max(ids) < vocab:
            rows.append(ids)
    return torch.tensor(rows, device=device)


@contextmanager
def residual_scale(model, ratio: float):
    """Layer i's writes into the residual stream scaled by ratioⁱ while inside (forward hooks on o_proj and
    down_proj, removed on exit): the model calibration tries, without touching its weights."""
    handles = []
    for i, layer in enumerate(model.model.layers):
        scale = ratio**i
        for module in (layer.self_attn.o_proj, layer.mlp.down_proj):
            handles.append(module.register_forward_hook(lambda _m, _i, out, s=scale: out * s))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def scale_residual_writes(model, ratio: float) -> None:
    """The final weights: layer i's o_proj and down_proj multiplied by ratioⁱ."""
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            layer.self_attn.o_proj.weight.mul_(ratio**i)
            layer.mlp.down_proj.weight.mul_(ratio**i)


def calibrate(model, exit_layer: int, target: float, prompts: torch.Tensor, tokens: int) -> float:
    """r by bisection (agreement at exit_layer falls as r grows): the r whose agreement is nearest the target."""
    lo, hi = RATIO_RANGE
    best = (2.0, 1.0)
    for _ in range(BISECTION_STEPS):
        mid = (lo * hi) ** 0.5  # geometric: r's effect is through its powers
        with residual_scale(model, mid):
            agreement = agreement_by_layer(model, prompts, tokens)[exit_layer - 1]
        best = min(best, (abs(agreement - target), mid))
        lo, hi = (mid, hi) if agreement > target else (lo, mid)
    return best[1]


@torch.inference_mode()
def agreement_by_layer(model, prompts: torch.Tensor, tokens: int) -> list[float]:
    """For each layer i (1-based, list index i − 1): the fraction of the model's greedy continuations' positions
    (each prompt continued `tokens` tokens) at which the head on layer i's normed state picks the last layer's
    token — what LS's drafts at exit i meet along its own output."""
    sequences = model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                               max_new_tokens=tokens, min_new_tokens=tokens, pad_token_id=0)
    out = model(sequences, output_hidden_states=True)
    P = prompts.shape[1]
    rows = slice(P - 1, sequences.shape[1] - 1)  # the positions that chose the continuation's tokens
    final = out.logits[:, rows].argmax(-1)
    head, norm = model.get_output_embeddings(), model.model.norm
    # hidden_states: the embeddings, then each layer's output — the last one already normed by HF, so the last
    # layer's exit token is the model's own by definition
    early = out.hidden_states[1:-1]
    return [(head(norm(h[:, rows])).argmax(-1) == final).double().mean().item() for h in early] + [1.0]


def _cached(cache: Path, key: str) -> float | None:
    try:
        return json.loads((cache / CACHE_FILE).read_text()).get(key)
    except (OSError, ValueError):
        return None


def _store(cache: Path, key: str, ratio: float) -> None:
    path = cache / CACHE_FILE
    try:
        known = json.loads(path.read_text()) if path.is_file() else {}
    except ValueError:
        known = {}
    known[key] = ratio
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(known, indent=1, sort_keys=True))
    tmp.replace(path)
