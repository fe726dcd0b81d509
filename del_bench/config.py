"""Config plumbing shared by the CLI, the runner and the tests: where configs live, the config groups as
a registry ("did you mean" for unknown names), and validation that runs before any model loads."""

from __future__ import annotations

import difflib
from pathlib import Path

from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf

from del_bench import calibration_store
from del_bench.engine.compiled import COMPILE_CHOICES, compile_setting
from del_bench.engine.sampling import Sampling
from del_bench.errors import ConfigError
from del_bench.models import exit_adapters
from del_bench.models.fused import LAYER_PATHS
from del_bench.models.loading import local_layers, local_name, weights_digest
from del_bench.models.products import SETTINGS as PRODUCT_SETTINGS
from del_bench.records import decoding_tag

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
GROUPS = ("model", "task", "method", "logger", "experiment", "scale", "data", "row")
# Short names a user may type for a config, each standing for one canonical config: the command line is rewritten
# before Hydra composes (resolve_aliases), so the config, its task_data, records, out_dir and pairing only ever see
# the canonical name. `task=cnndm` (the model cards' command) is the paper's CNN/DM by default: 1-shot summarisation
# (Appendix B: "we use 1-shot summarization for CNN/DM"; Table 6, Figures 3b and 4; README "Tasks").
ALIASES = {"task": {"cnndm": "cnndm_sum"}}


def _calibrated(key: str, default, _root_):
    """${calibrated:exit_layer,DEFAULT}: with calibration.use=true, `key` of the best LS grid point that
    `python -m del_bench calibrate` wrote for this model and calibration.task; otherwise DEFAULT."""
    calibration = _root_.get("calibration")
    if calibration is None or not calibration.get("use"):
        return default
    return calibration_store.lookup(calibration.file, calibration.task)[key]


def _at_scale(paper, local, _root_):
    """${at_scale:PAPER,LOCAL}: an experiment's setting at each scale (configs/scale/: scale=paper, the default, or
    scale=local), so one experiment file holds both its paper-size sweep and its size on this CPU."""
    scale = _root_.get("scale")
    return local if scale is not None and scale.get("name") == "local" else paper


def _flag(on, name: str) -> str:
    """${flag:${.tree},tree}: "-tree" when the switch is on, "" when off — for tags that name an option."""
    return f"-{name}" if on else ""


def batch_tag(batch_size) -> str:
    """${batch_tag:${batch_size}}: out_dir's suffix for a batched run ("-b8"), none at batch size 1 (every earlier run's
    directory), so runs of different batch sizes never resume into one another."""
    return "" if str(batch_size) == "1" else f"-b{batch_size}"


if not OmegaConf.has_resolver("batch_tag"):
    OmegaConf.register_new_resolver("batch_tag", batch_tag)
if not OmegaConf.has_resolver("flag"):
    OmegaConf.register_new_resolver("flag", _flag)
if not OmegaConf.has_resolver("decoding"):
    OmegaConf.register_new_resolver("decoding", decoding_tag)
if not OmegaConf.has_resolver("calibrated"):
    OmegaConf.register_new_resolver("calibrated", _calibrated)
if not OmegaConf.has_resolver("at_scale"):
    OmegaConf.register_new_resolver("at_scale", _at_scale)
if not OmegaConf.has_resolver("model_variant"):  # out_dir: `<model>+exits-<digest8>` with model.exit_adapters
    OmegaConf.register_new_resolver("model_variant", exit_adapters.model_variant)
if not OmegaConf.has_resolver("weights_digest"):  # cached: a config resolved twice hashes the weights once
    OmegaConf.register_new_resolver("weights_digest", weights_digest, use_cache=True)
if not OmegaConf.has_resolver("local_layers"):  # model=local: the layer count read from DIR/config.json
    OmegaConf.register_new_resolver("local_layers", local_layers, use_cache=True)
if not OmegaConf.has_resolver("local_name"):
    OmegaConf.register_new_resolver("local_name", local_name)


def choices(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml"))


def describe(group: str, name: str) -> str:
    """The first comment line of a config file: its one-line description."""
    for line in (CONFIG_DIR / group / f"{name}.yaml").read_text().splitlines():
        if line.startswith("#") and not line.startswith("# @package"):
            return line.lstrip("# ").strip()
    return ""


def check_choice(group: str, name: str) -> None:
    options = choices(group)
    if name in options or name in ALIASES.get(group, {}) or name in ("null", ""):
        return
    suggestion = did_you_mean(name, [*options, *ALIASES.get(group, {})])
    raise ConfigError(f"unknown {group} {name!r}.{suggestion} Available: {', '.join(options)} "
                      f"(`python -m del_bench ls` describes them)")


def canonical(group: str, name: str) -> str:
    """The config an alias stands for (other names unchanged)."""
    return ALIASES.get(group, {}).get(name, name)


def did_you_mean(name: str, options) -> str:
    close = difflib.get_close_matches(name, list(options), n=3, cutoff=0.5)
    return f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


def load_choice(group: str, name: str) -> DictConfig:
    """One config file of a group by name (unknown names: ConfigError with suggestions), outside Hydra's compose."""
    check_choice(group, name)
    return OmegaConf.load(CONFIG_DIR / group / f"{canonical(group, name)}.yaml")


def ls_setting(model: str, task: str | None = None, calibration_file: str | Path | None = None) -> tuple[int, int]:
    """LS's (E, γ) on `model`, where `method=ls` takes them: the task's best grid point in a calibration file (what
    `python -m del_bench calibrate` wrote; calibration.use=true) when one is given and holds the task, else the model
    config's default_exit_layer / default_gamma. Benches and scripts take (E, γ) from here, never from a constant."""
    if calibration_file and task:
        entry = calibration_store.read(calibration_file).get(task)
        if entry:
            return int(entry["exit_layer"]), int(entry["gamma"])
    cfg = load_choice("model", model)
    return int(cfg.default_exit_layer), int(cfg.default_gamma)


def ls_grid(model: str) -> list[tuple[int, int]]:
    """Every (E, γ) of the grid `calibrate` searches on `model` (configs/command/calibrate.yaml's grids), E-major."""
    grids = OmegaConf.load(CONFIG_DIR / "command" / "calibrate.yaml").grids
    if model not in grids:
        raise ConfigError(f"no calibration grid for model {model!r}: add it under `grids` in "
                          f"configs/command/calibrate.yaml (models with one: {', '.join(grids)})")
    return [(int(e), int(g)) for e in grids[model].exit_layers for g in grids[model].gammas]


def _group_of(key: str) -> str:
    """The config group an override's key names (`+task`, `override task` → task), else the key itself."""
    key = key.lstrip("+~")
    return key.split(" ", 1)[1] if key.startswith("override ") else key


def resolve_aliases(overrides: list[str]) -> list[str]:
    """The command line with every aliased choice replaced by its canonical name (`task=cnndm` → `task=cnndm_sum`;
    sweeps too: `task=cnndm,xsum`), for Hydra to compose."""
    out = []
    for override in overrides:
        key, sep, value = override.partition("=")
        aliases = ALIASES.get(_group_of(key), {}) if sep else {}
        if any(name.strip() in aliases for name in value.split(",")):
            override = f"{key}={','.join(aliases.get(name.strip(), name) for name in value.split(','))}"
        out.append(override)
    return out


def check_overrides(overrides: list[str]) -> None:
    """Check `group=name` command-line choices before Hydra composes (its own error has no suggestion)."""
    for override in overrides:
        key, sep, value = override.partition("=")
        key = _group_of(key)
        if sep and key in GROUPS:
            for name in value.split(","):  # multirun sweeps: method=vanilla,ls
                check_choice(key, name.strip())


WARMUP_MODES = ("auto", "quick", "steady", "off")  # the untimed warm-up (runner.warm_up)


def check_warmup(cfg: DictConfig) -> None:
    """The warm-up settings (configs/run.yaml, runner.warm_up): a mode, whole tokens and passes, a tolerance."""
    mode = cfg.get("warmup", "auto")
    if mode is not False and mode not in WARMUP_MODES:
        raise ConfigError(f"warmup={mode!r} is not a warm-up.{did_you_mean(str(mode), WARMUP_MODES)} Options: "
                          f"{', '.join(WARMUP_MODES)}")
    for key, least in (("warmup_tokens", 0), ("warmup_passes", 2)):
        value = cfg.get(key, least)
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ConfigError(f"{key}={value!r} must be an integer ≥ {least}")
    tolerance = cfg.get("warmup_tolerance", 0.1)
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0 < tolerance < 1:
        raise ConfigError(f"warmup_tolerance={tolerance!r} must be a fraction in (0, 1)")


def validate(cfg: DictConfig) -> None:
    """Everything checkable without weights: method hyperparameters against the model's depth,
    generation settings, limits. Raises ConfigError with the offending key."""
    for key in ("model", "task", "method"):
        if key not in cfg:
            raise ConfigError(f"no {key} chosen; add {key}=NAME (options: {', '.join(choices(key))})")
    try:
        num_layers = int(cfg.model.num_layers)
        method_cls = get_class(cfg.method._target_)
        params = {k: v for k, v in OmegaConf.to_container(cfg.method, resolve=True).items() if not k.startswith("_")}
        method_cls(**params).validate(num_layers)
        Sampling(**OmegaConf.to_container(cfg.generation, resolve=True))
    except (ValueError, TypeError) as err:
        raise ConfigError(f"invalid config for method={cfg.method.name} model={cfg.model.name}: {err}") from err
    layers = cfg.get("layers", "auto")
    if layers not in LAYER_PATHS:
        raise ConfigError(f"layers={layers!r} is not a decoder-layer loop.{did_you_mean(str(layers), LAYER_PATHS)} "
                          f"Options: {', '.join(LAYER_PATHS)}")
    products = cfg.get("products", "auto")
    if products not in PRODUCT_SETTINGS:
        raise ConfigError(f"products={products!r} is not a product layout."
                          f"{did_you_mean(str(products), PRODUCT_SETTINGS)} Options: {', '.join(PRODUCT_SETTINGS)}")
    setting = compile_setting(cfg.get("compile", "auto"))
    if setting not in COMPILE_CHOICES:
        raise ConfigError(f"compile={setting!r} is not a choice.{did_you_mean(str(setting), COMPILE_CHOICES)} Options: "
                          f"{', '.join(COMPILE_CHOICES)}")
    check_warmup(cfg)
    validate_batch(cfg, method_cls, setting)
    if cfg.limit is not None and (not isinstance(cfg.limit, int) or cfg.limit < 1):
        raise ConfigError(f"limit={cfg.limit!r} must be a positive integer or null (all samples)")
    if not isinstance(cfg.max_new_tokens, int) or cfg.max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens={cfg.max_new_tokens!r} must be a positive integer")
    n = cfg.task.get("samples_per_prompt", 1)
    if not isinstance(n, int) or n < 1:
        raise ConfigError(f"task.samples_per_prompt={n!r} must be a positive integer")


def validate_batch(cfg: DictConfig, method_cls, compile_choice: str) -> None:
    """batch_size: a positive integer; above 1 (engine/batch.py) our engine decodes, on the stack's layer loop."""
    batch = cfg.get("batch_size", 1)
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ConfigError(f"batch_size={batch!r} must be a positive integer (1 = one prompt at a time)")
    if batch == 1:
        return
    if getattr(method_cls, "decoder", None) is not None:
        raise ConfigError(f"method={cfg.method.name} is transformers' own decoding (a peer row), which decodes one "
                          "prompt at a time: use batch_size=1")
    if compile_choice == "on":
        raise ConfigError("compile=on: the graph-captured steps serve batch size 1; a batched run decodes on the "
                          "stack's layer loop (compile=auto or off)")
