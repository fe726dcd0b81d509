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

Random text is not what a task's prompts are: an agreement calibrated on it need not hold on real prompts (asked 0.6
at SmolLM2's shape, LS met 0.13 on held-out WMT14/XSum/GSM8K prompts). `model.calibrate_on=task` calibrates on the
run task's calibration draw instead (selection.calibration_samples: records outside the evaluation set, each at most
its last `calibration_prompt_tokens` tokens, each continued on its own), and every run records, beside what
calibration met, the agreement by layer along its own prompts (session.build: setup["synthetic"]["on_run_prompts"]).

That is the `uniform` agreement profile (`model.agreement_profile`, the default): the agreement does not depend on
the context, so a method that adapts to the context can at best tie the best static one. The `segments` profile
(models/synthetic_segments.py) agrees at two levels by stretches of the generation; its constants are calibrated and
cached the same way, under a key of their own.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from del_bench.errors import ConfigError
from del_bench.models import synthetic_segments as segments

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
PROFILES = ("uniform", "segments")  # model.agreement_profile: one agreement everywhere, or two by context
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


def build(cfg, dtype: torch.dtype, tokenizer, cache: Path, texts: list[str] | None = None):
    """The synthetic model of `cfg` (source: synthetic) on cfg.device in `dtype`, calibrated (its constants cached in
    the directory `cache`) on seeded random text or, given `texts` (model.calibrate_on=task: the task's calibration
    draw; run: the run's own prompts), on those texts, each at its own length (at most its last
    calibration_prompt_tokens): → the model."""
    shape = shape_of(cfg)
    E, target = int(cfg.default_exit_layer), float(cfg.get("agreement", 0.8))
    profile = cfg.get("agreement_profile", "uniform")
    if not 0 < target < 1:
        raise ConfigError(f"model.agreement={target}: an agreement is a fraction of tokens, in (0, 1)")
    if not 1 <= E < shape["layers"]:
        raise ConfigError(f"model.default_exit_layer={E}: an exit layer of a {shape['layers']}-layer model is in "
                          f"[1, {shape['layers'] - 1}]")
    if profile not in PROFILES:
        raise ConfigError(f"model.agreement_profile={profile!r}: one of {', '.join(PROFILES)}")
    if texts is not None and profile != "uniform":
        raise ConfigError(f"model.calibrate_on={cfg.get('calibrate_on')} calibrates the uniform profile; the segments "
                          "profile calibrates on random text (model.calibrate_on=random)")
    device = torch.device(cfg.get("device") or "cpu")
    eos = getattr(tokenizer, "eos_token_id", None)
    t0 = time.perf_counter()
    model = random_llama(llama_config(shape, eos_token_id=eos), dtype, device, int(cfg.get("seed", 0)))
    built_s = time.perf_counter() - t0
    if texts is None:
        prompts = calibration_prompts(tokenizer, shape["vocab"], int(cfg.get("calibration_prompts", 8)), device)
        lengths = prompts.shape
    else:  # each text at its own length: agreement depends on how long a context the layers attend over
        longest = int(cfg.get("calibration_prompt_tokens", 2048))
        prompts = text_prompts(tokenizer, texts, shape["vocab"], longest, device)
        lengths = tuple(p.shape[1] for p in prompts)
    tokens = int(cfg.get("calibration_tokens", 32))
    calibration_ids = ids_digest(prompts)
    key = f"{cfg.shape}:{shape}:seed{cfg.get('seed', 0)}:E{E}:{target}:{dtype}:{device.type}:{lengths}:{tokens}"
    if texts is not None:  # the same texts, the same constants: the key names their ids
        key += f":texts-{calibration_ids}"
    t0 = time.perf_counter()
    if profile == "segments":
        model.synthetic = build_segments(model, cfg, E, prompts, tokens, cache, key)
    else:
        model.synthetic = build_uniform(model, E, target, prompts, tokens, cache, key)
    model.synthetic.update(shape=cfg.shape, build_s=round(built_s, 2), calibration_s=round(time.perf_counter() - t0, 2),
                           calibrated_on="random" if texts is None else cfg.get("calibrate_on", "task"),
                           calibration_prompt_lengths=list(lengths), calibration_ids=calibration_ids)
    model.agreement_on_prompts = {}  # agreement_on's measurements: the weights are fixed from here on
    log.info("synthetic %s (%s): r = %.4f, agreement at layer %d %.3f", cfg.shape, profile,
             model.synthetic["ratio"], E, model.synthetic["agreement"])
    return model


def build_uniform(model, E: int, target: float, prompts: torch.Tensor, tokens: int, cache: Path, key: str) -> dict:
    """The uniform profile: r calibrated (or cached under `key`) and put in the weights → what model.synthetic
    records."""
    ratio = _cached(cache, key)
    if ratio is None:
        ratio = calibrate(model, E, target, prompts, tokens)
        _store(cache, key, ratio)
    scale_residual_writes(model, ratio)
    profile = agreement_by_layer(model, prompts, tokens)
    return {"ratio": ratio, "target_agreement": target, "exit_layer": E,
            "agreement_by_layer": [round(a, 4) for a in profile], "agreement": round(profile[E - 1], 4)}


def build_segments(model, cfg, E: int, prompts: torch.Tensor, tokens: int, cache: Path, key: str) -> dict:
    """The segments profile (models/synthetic_segments.py): its constants calibrated (or cached) and put in the
    weights, then measured once more along longer continuations → what model.synthetic records."""
    high, low = float(cfg.get("agreement_high", 0.95)), float(cfg.get("agreement_low", 0.3))
    T, k = int(cfg.get("segment_tokens", 32)), int(cfg.get("mode_neurons", 16))
    flatten = float(cfg.get("flatten", segments.FLATTEN))
    if not 0 < low < high < 1:
        raise ConfigError(f"model.agreement_low={low}, model.agreement_high={high}: need 0 < low < high < 1")
    modes = segments.draw(model, E, k, int(cfg.get("seed", 0)))
    key = f"{key}:segments-v{segments.VERSION}:{high}:{low}:{T}:{k}:f{flatten}"
    longer = max(tokens, 4 * T)  # a segment's switch is seen only along continuations several segments long
    constants = _cached(cache, key)
    if constants is None:
        constants = calibrate_segments(model, modes, E, (high, low, T, flatten), prompts, (tokens, longer))
        _store(cache, key, constants)
    else:
        apply_segments(model, modes, E, constants)
    matches, inputs = exit_matches(model, prompts, longer)
    overall = [m.double().mean().item() for m in matches] + [1.0]
    by_kind, positions = segments.agreement_by_kind(matches, inputs, modes.sign)
    continuation = inputs[:, 1:]  # the generated tokens but the last
    confidence = segments.confidence_by_kind(model, inputs, prompts, E, modes.sign)
    return {"profile": "segments", **constants, "target_agreement": {"high": high, "low": low},
            "target_segment_tokens": T, "mode_neurons": k, "flatten": flatten, "exit_layer": E,
            "agreement_by_layer": [round(a, 4) for a in overall], "agreement": round(overall[E - 1], 4),
            "agreement_by_kind": {kind: _rounded(a[E - 1]) for kind, a in by_kind.items()},
            "agreement_by_layer_by_kind": {kind: [_rounded(x) for x in a] for kind, a in by_kind.items()},
            "confidence_by_kind": {kind: _rounded(x, 8) for kind, x in confidence.items()},
            "positions_by_kind": positions, "segment_tokens_by_kind": segments.segment_lengths(continuation,
                                                                                                modes.sign),
            "switch_rate": round(segments.switch_rate(continuation, modes.sign), 4), "measured_tokens": longer}


def calibrate_segments(model, modes, E: int, targets: tuple, prompts: torch.Tensor, tokens: tuple[int, int]) -> dict:
    """The segments profile's constants, each calibrated with the ones before it in the weights (targets: agreement
    high, low, segment tokens, flatten; tokens: continuations for the agreements, for the segments): c from layer
    1's write; r (writers off) for `high` at high-kind positions; the gates' gain from the mode's margin; the
    writers' scale for `low` at low-kind positions; the persistence s for a switch every T tokens."""
    high, low, T, flatten = targets
    c = segments.MODE_SHARE * segments.layer_one_write(model, prompts)
    segments.install(model, modes, c, flatten, E)

    def high_agreement(ratio: float) -> float:  # at high-kind positions: where the writers will stay silent
        with residual_scale(model, ratio):
            matches, inputs = exit_matches(model, prompts, tokens[0], [E])
        return segments.agreement_by_kind(matches, inputs, modes.sign)[0]["high"][0] or 0.0

    ratio = segments.bisect(high_agreement, RATIO_RANGE, high, BISECTION_STEPS)
    scale_residual_writes(model, ratio)
    gain = segments.GATE_ON / segments.mode_margin(model, prompts, E, modes.u)

    def low_agreement(scale: float) -> float:
        segments.write(model, modes, E, gain, scale * c)
        matches, inputs = exit_matches(model, prompts, tokens[0], [E])
        return segments.agreement_by_kind(matches, inputs, modes.sign)[0]["low"][0] or 0.0

    scale = segments.bisect(low_agreement, segments.WRITER_RANGE, low, BISECTION_STEPS)
    segments.write(model, modes, E, gain, scale * c)

    def switches(s: float) -> float:
        segments.persist(model, modes, s)
        return segments.switch_rate(greedy(model, prompts, tokens[1])[:, prompts.shape[1]:], modes.sign)

    s = segments.bisect(switches, segments.PERSIST_RANGE, 1 / T, BISECTION_STEPS)
    segments.persist(model, modes, s)
    return {"ratio": ratio, "mode_scale": c, "gate_gain": gain, "writer_scale": scale, "persistence": s,
            "flatten": flatten}


def apply_segments(model, modes, E: int, constants: dict) -> None:
    """The cached constants put in the weights, in calibrate_segments' order (the same weights it left)."""
    segments.install(model, modes, constants["mode_scale"], constants["flatten"], E)
    scale_residual_writes(model, constants["ratio"])
    segments.write(model, modes, E, constants["gate_gain"], constants["writer_scale"] * constants["mode_scale"])
    segments.persist(model, modes, constants["persistence"])


def _rounded(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def profile_tag(*, _parent_, _root_) -> str:
    """${synthetic_profile:} in a synthetic model config's `weights`: "" for the uniform profile (the weights' name
    as it always was), else the segments profile's settings, so runs of other settings never pair or resume; and
    "-cal-task" where the model is calibrated on the run task's prompts (its weights then depend on the task),
    "-cal-run-l<limit>-s<seed>" where on the run's own (they depend on its selection too: the task is in the run's
    key and directory, the selection only here)."""
    mode = _parent_.get("calibrate_on", "random")
    calibrated = "" if mode == "random" else f"-cal-{mode}"
    if mode == "run" and "seed" in _root_:  # a run config (not a model config alone): its selection
        limit = _root_.get("limit")
        calibrated += f"-l{'all' if limit is None else limit}-s{_root_.seed}"
    if _parent_.get("agreement_profile", "uniform") == "uniform":
        return calibrated
    keys = ("agreement_high", "agreement_low", "segment_tokens", "mode_neurons", "flatten")
    high, low, tokens, neurons, flatten = (_parent_.get(k) for k in keys)
    return f"-segments-h{high}-l{low}-T{tokens}-k{neurons}" + (f"-f{flatten}" if flatten else "") + calibrated


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


def text_prompts(tokenizer, texts: list[str], vocab: int, length: int, device) -> list[torch.Tensor]:
    """[1, nᵢ] ids a text: each text's last nᵢ ≤ `length` tokens, at its own length (calibration continues each on
    its own, as a run decodes it)."""
    rows = [tokenizer(text)["input_ids"][-length:] for text in texts]
    if min(len(ids) for ids in rows) < 1:
        raise ConfigError("model.calibrate_on: a calibration prompt of the task tokenizes to nothing")
    if max(max(ids) for ids in rows) >= vocab:
        raise ConfigError(f"model.calibrate_on: the tokenizer gives ids beyond the shape's {vocab}-token "
                          "vocabulary; use a tokenizer of that size (model.tokenizer) or a larger model.vocab_size")
    return [torch.tensor([ids], device=device) for ids in rows]


def ids_digest(prompts: torch.Tensor | list[torch.Tensor]) -> str:
    """A short digest of prompt ids: which prompts a calibration saw (the cache key, the run's setup)."""
    ids = prompts.tolist() if isinstance(prompts, torch.Tensor) else [p.tolist() for p in prompts]
    return hashlib.sha1(json.dumps(ids).encode()).hexdigest()[:12]


@torch.inference_mode()
def agreement_on(model, prompts: list[list[int]], tokens: int) -> dict:
    """The agreement by layer along the model's greedy continuations (`tokens` each) of the given prompts, each
    prompt continued on its own (they differ in length): what the run's prompts meet, beside what calibration met.
    Measured once per prompts and length on a built model (every row of a bench that shares one load asks again)."""
    device = next(model.parameters()).device
    rows = [torch.tensor([ids], device=device) for ids in prompts]  # [1, Pᵢ] each
    measured, key = model.agreement_on_prompts, (ids_digest(rows), tokens)
    if key not in measured:
        by_layer = [round(a, 4) for a in agreement_by_layer(model, rows, tokens)]
        measured[key] = {"prompts": len(rows), "tokens": tokens, "agreement_by_layer": by_layer}
    return dict(measured[key])


def matches_along(model, prompts: torch.Tensor | list[torch.Tensor], tokens: int,
                  layers: list[int] | None = None) -> torch.Tensor:
    """exit_matches' [layers, B, tokens] of a batch of equal-length prompts, or of a list of [1, P] prompts each
    continued on its own (B = the list's length)."""
    if isinstance(prompts, torch.Tensor):
        return exit_matches(model, prompts, tokens, layers)[0]
    return torch.cat([exit_matches(model, p, tokens, layers)[0] for p in prompts], 1)


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
        with residual_scale(model, mid):  # the exit layer's matches alone: the same bits as among all layers'
            agreement = matches_along(model, prompts, tokens, [exit_layer]).double().mean().item()
        best = min(best, (abs(agreement - target), mid))
        lo, hi = (mid, hi) if agreement > target else (lo, mid)
    return best[1]


@torch.inference_mode()
def agreement_by_layer(model, prompts: torch.Tensor | list[torch.Tensor], tokens: int) -> list[float]:
    """For each layer i (1-based, list index i − 1): the fraction of the model's greedy continuations' positions
    (each prompt continued `tokens` tokens) at which the head on layer i's normed state picks the last layer's
    token — what LS's drafts at exit i meet along its own output."""
    return [m.double().mean().item() for m in matches_along(model, prompts, tokens)] + [1.0]


@torch.inference_mode()
def greedy(model, prompts: torch.Tensor, tokens: int) -> torch.Tensor:
    """[B, P] → [B, P + tokens]: the prompts and their greedy continuations."""
    return model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False, max_new_tokens=tokens,
                          min_new_tokens=tokens, pad_token_id=0)


@torch.inference_mode()
def exit_matches(model, prompts: torch.Tensor, tokens: int,
                 layers: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Along the greedy continuations: [L − 1, B, tokens] bool, whether the head on layer i's normed state (index
    i − 1) picks the last layer's token at each position that chose a continuation token — or [len(layers), B,
    tokens] for the 1-based `layers` given (a bisection reads one: the head over every layer is most of the cost) —
    and [B, tokens] those positions' input tokens."""
    sequences = greedy(model, prompts, tokens)
    out = model(sequences, output_hidden_states=True)
    P = prompts.shape[1]
    rows = slice(P - 1, sequences.shape[1] - 1)  # the positions that chose the continuation's tokens
    final = out.logits[:, rows].argmax(-1)
    head, norm = model.get_output_embeddings(), model.model.norm
    # hidden_states: the embeddings, then each layer's output — the last one already normed by HF, so the last
    # layer's exit token is the model's own by definition
    early = out.hidden_states[1:-1] if layers is None else [out.hidden_states[i] for i in layers]
    return torch.stack([head(norm(h[:, rows])).argmax(-1) == final for h in early]), sequences[:, rows]


def _cached(cache: Path, key: str) -> float | dict | None:
    try:
        return json.loads((cache / CACHE_FILE).read_text()).get(key)
    except (OSError, ValueError):
        return None


def _store(cache: Path, key: str, ratio: float | dict) -> None:
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
