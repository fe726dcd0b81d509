"""Config plumbing shared by the CLI, the runner and the tests: where configs live, the config groups as
a registry ("did you mean" for unknown names), and validation that runs before any model loads."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import MISSING, dataclass
from pathlib import Path
from typing import Literal

from hydra.utils import get_class, instantiate
from omegaconf import DictConfig, OmegaConf

from del_bench import calibration_store
from del_bench.engine import compiled, path_choice
from del_bench.engine.compiled import compile_setting
from del_bench.engine.sampling import Sampling
from del_bench.errors import ConfigError
from del_bench.methods.base import MethodConfig
from del_bench.models import exit_adapters, synthetic
from del_bench.models.loading import ModelConfig, local_layers, local_name, weights_digest
from del_bench.models.products import SETTINGS as PRODUCT_SETTINGS
from del_bench.records import decoding_tag
from del_bench.schema import LAYERS, check, did_you_mean, key, rows
from del_bench.tasks.base import TaskConfig

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


def model_dir(*, _root_) -> str:
    """The `${model_dir:}` resolver (out_dir's model part): the model's name — for a synthetic model its weights'
    identity (agreement, exit layer, seed, profile: `model.weights`), so runs of another agreement get their own
    directories instead of a RunConflict in one; `+exits-<digest8>` with model.exit_adapters."""
    model = _root_.model
    name = model.weights if model.get("source") == "synthetic" else model.name
    return exit_adapters.model_variant(name, model.get("exit_adapters"))


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
if not OmegaConf.has_resolver("model_dir"):  # out_dir's model part
    OmegaConf.register_new_resolver("model_dir", model_dir)
if not OmegaConf.has_resolver("weights_digest"):  # cached: a config resolved twice hashes the weights once
    OmegaConf.register_new_resolver("weights_digest", weights_digest, use_cache=True)
if not OmegaConf.has_resolver("local_layers"):  # model=local: the layer count read from DIR/config.json
    OmegaConf.register_new_resolver("local_layers", local_layers, use_cache=True)
if not OmegaConf.has_resolver("synthetic_profile"):  # a synthetic model's weights: its agreement profile's settings
    OmegaConf.register_new_resolver("synthetic_profile", synthetic.profile_tag)
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
        written, sep, value = override.partition("=")
        group = _group_of(written)
        if sep and group in GROUPS:
            for name in value.split(","):  # multirun sweeps: method=vanilla,ls
                check_choice(group, name.strip())


def compose_checked(config_name: str, overrides: list[str]) -> DictConfig:
    """configs/<config_name>.yaml with `overrides` (aliases resolved), composed as Hydra composes a run and validated:
    a ConfigError naming the bad key, its value and what is allowed — before a Hydra job starts (and makes out_dir)
    or anything loads."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    overrides = resolve_aliases(overrides)
    check_overrides(overrides)
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            cfg = compose(config_name=config_name, overrides=overrides)
    except (HydraException, OmegaConfBaseException) as err:
        raise ConfigError(composition_error(err)) from None
    validate(cfg)
    return cfg


def _declared(path: str, parent: DictConfig) -> list[str]:
    """The keys the schema declares where `path` points: the run's own, or a group's by its choice ([]: not known)."""
    group, dot, rest = path.partition(".")
    if not dot:
        return [f.name for f in dataclasses.fields(RunConfig)]
    if group not in KEY_GROUPS or "." in rest:
        return []
    try:
        schema = typing.get_type_hints(RunConfig)[group].schema_for(parent)
    except Exception:  # noqa: BLE001 — a _target_ that does not import: the config's own keys will do
        return []
    return [f.name for f in dataclasses.fields(schema)]


def composition_error(err: Exception) -> str:
    """Hydra's refusal of a command line in one sentence; a key no config has gets the keys it may have meant."""
    cause = err.__cause__
    parent = getattr(cause, "parent_node", None)
    if isinstance(parent, DictConfig) and getattr(cause, "full_key", None):
        path, name = cause.full_key, cause.key
        where = path.rpartition(".")[0] or "the run config"
        chosen = parent.get("name") if "." in path else None  # a group's choice: "method del_cpu"
        where += f" {chosen}" if isinstance(chosen, str) else ""
        keys = _declared(path, parent) or [k for k in parent.keys() if isinstance(k, str) and k != "hydra"]
        keys = [k for k in keys if not k.startswith("_")]
        if name in keys:  # a key its schema declares that its config file leaves out: Hydra adds it with +
            return f"{path}: {where} does not set it; add it with +{path}=…"
        return f"{path}: not a key of {where}.{did_you_mean(name, keys)} Its keys: {', '.join(keys) or 'none'}"
    lines = [line.strip() for line in str(err).splitlines() if line.strip() and not line.startswith("See https")]
    return ": ".join(lines)


WARMUP_MODES = ("auto", "quick", "steady", "off")  # the untimed warm-up (runner.warm_up)
SAMPLE_SETS = ("eval", "calibration")  # which samples a run decodes (del_bench/selection.py)


def _off(value):
    """YAML reads a bare `off` as false."""
    return "off" if value is False else value


# ---- the run config's schema: every key of configs/run.yaml and of each group (del_bench/schema.py) -------------
@dataclass(kw_only=True)
class Calibration:
    use: bool = key(False, "true: LS, FS, DV and DEL-γ take E (and γ) from `file` instead of the model's defaults")
    file: str = key("results/calibration/${model.name}.yaml", "the calibration file `calibrate` writes")
    task: str = key("${task.name}", "whose best (E, γ) to use")
    samples: int = key(10, "calibrate: samples drawn apart from the evaluation set", ge=1)
    eval_limit: int | None = key(None, "calibrate: the evaluation selection to stay clear of (null: the task's n)",
                                 ge=1)
    dir: str | None = key(None, "calibrate: where its grid's runs go")


@dataclass(kw_only=True)
class Grid:
    exit_layers: list[int] = key(MISSING, "calibrate: the grid's E; its default is the model's under `grids` in "
                                          "configs/command/calibrate.yaml", ge=1, lt=LAYERS)
    gammas: list[int] = key(MISSING, "calibrate: the grid's γ; its default is the model's under `grids` too", ge=1)


@dataclass(kw_only=True)
class Scale:
    name: Literal["paper", "local"] = key("paper", "an experiment at the paper's size or on this CPU")
    root: str = key("${records_root}", "where this scale's runs go")
    suffix: str = key("", "appended to the experiment's name in run_key.experiments")


@dataclass(kw_only=True)
class LoggerConfig:
    name: Literal[LOGGER_NAMES] = key("none", "none: the records only; wandb: mirrored to Weights & Biases")

    @staticmethod
    def schema_for(node) -> type:
        return LOGGERS.get(node.get("name"), LoggerConfig)


@dataclass(kw_only=True)
class WandbLogger(LoggerConfig):
    mode: Literal["online", "offline", "disabled", "auto"] = key("auto", "auto: online with an API key, else offline")
    project: str = key("del-bench", "the W&B project")
    entity: str | None = key(None, "the W&B entity (null: yours)")
    group: str | None = key(None, "null: the experiment's name")
    job_type: str | None = key(None, "null: the method tag")
    tags: list[str] = key([], "added to model, task and method name")
    dir: str | None = key(None, "null: the run's out_dir")
    timeout: float = key(60, "seconds the run waits for the whole mirror", gt=0)
    figures: list[str] = key([], "extra image globs to attach")


LOGGERS = {"none": LoggerConfig, "wandb": WandbLogger}
LOGGER_NAMES = tuple(LOGGERS)


@dataclass(kw_only=True)
class RunConfig:
    """configs/run.yaml: the run's own keys; the groups' keys come from their choices (`python -m del_bench ls`). A
    default here is run.yaml's (tests hold them equal), for a config composed without it."""

    model: ModelConfig = key(MISSING, "the model (`ls model`: each one's keys)")
    task: TaskConfig = key(MISSING, "the task (`ls task`)")
    method: MethodConfig = key(MISSING, "the method (`ls method`)")
    logger: LoggerConfig = key(MISSING, "the experiment tracker (`ls logger`)")
    limit: int | None = key(None, "samples to decode, drawn with seed (null: the task's n)", ge=1)
    max_new_tokens: int = key(512, "tokens generated per output at most", ge=1)
    seed: int = key(42, "the sample draw's and the sampling RNG's seed", ge=0)
    batch_size: int = key(1, "prompts decoded together (1: one at a time)", ge=1)
    threads: int | None = key(2, "torch threads on CPU (null: torch's default)", ge=1)
    warmup: Literal[WARMUP_MODES] = key("auto", "the untimed warm-up (auto: steady on CUDA, quick elsewhere)",
                                        read=_off)
    warmup_tokens: int = key(16, "quick: tokens of its one generation (0: no warm-up)", ge=0)
    warmup_passes: int = key(5, "steady: the most passes", ge=2)
    warmup_tolerance: float = key(0.1, "steady: two passes agree within this fraction of ms/token", gt=0, lt=1)
    layers: Literal[path_choice.LAYER_SETTINGS] = key(
        "auto", "the decoder-layer loop (auto: fused where it matches eager here)")
    products: Literal[PRODUCT_SETTINGS] = key("auto", "the matrix products' layout (auto: the fastest timed at load)")
    # read from engine/compiled.py as the check runs: a choice added there is a choice here
    compile: Literal[compiled.COMPILE_CHOICES] = key(
        "auto", "graph-captured decode steps (on: inductor's fused kernels; graphs: the eager kernels, CUDA only; "
        "auto: on CUDA the fused graphs, else the unfused, else none)", read=compile_setting)
    generation: Sampling | None = key(None)
    data_dir: str = key(MISSING, "offline task data (data=local); DEL_BENCH_DATA sets it")
    calibration: Calibration | None = key(None)
    decoding: str = key(MISSING, "greedy or sample-t…-p…, from the generation keys (and the task's own)")
    records_root: str = key("results/runs", "where runs are written")
    experiment_name: str | None = key(None, "the sweep that asked for the run (set by each experiment)")
    out_dir: str = key(MISSING, "the run's directory (default: named from everything that matters)")
    scale: Scale | None = key(None)
    sample_set: Literal[SAMPLE_SETS] = key("eval", "calibration: calibrate's samples, apart from the evaluation set")
    grid: Grid | None = key(None)
    grids: dict | None = key(None, "calibrate: each model's default grid")
    rows: dict | None = key(None, "an experiment's (E, γ) rows per model (configs/row)")


KEY_GROUPS = ("model", "task", "method", "logger")  # groups whose keys depend on the choice (RunConfig's first fields)


def described_keys(group: str | None = None, name: str | None = None) -> list[tuple[str, str, str, str]]:
    """(key, accepts, default, meaning) of the run's own keys, or of choice `name` of a group in KEY_GROUPS: its schema
    (by its source or class) with the defaults its config composes to, interpolations as written."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name="run", overrides=[f"{group}={name}"] if group else [])
    if group is None:
        written = OmegaConf.to_container(cfg, resolve=False)
        return [row for row in rows(RunConfig, written) if row[0] not in KEY_GROUPS]
    written = OmegaConf.to_container(cfg[group], resolve=False)
    base = typing.get_type_hints(RunConfig)[group]
    return rows(base.schema_for(written), written)


def keys_table() -> str:
    """The run's keys as README's table: what each accepts, its default and what it means."""
    lines = ["| key | accepts | default | meaning |", "|---|---|---|---|"]
    lines += [f"| `{k}` | {accepts} | `{default}` | {meaning.replace('|', '/')} |"
              for k, accepts, default, meaning in described_keys()]
    return "\n".join(lines)


def facts(cfg: DictConfig) -> dict:
    """What ranges may be bounded by: the chosen model's layer count L, where it is a positive integer."""
    try:
        layers = cfg.model.num_layers
    except Exception:  # noqa: BLE001 — unresolvable: the model's own check says so
        return {}
    return {"num_layers": layers} if isinstance(layers, int) and not isinstance(layers, bool) and layers >= 1 else {}


def validate(cfg: DictConfig) -> None:
    """Every key of a composed run config against the schemas (the run's, and each group's by its choice: the model's
    source, the method's and the task's class), then what only the whole config can say. Raises one ConfigError that
    names every bad key, its value and what is allowed; nothing is loaded."""
    for group in ("model", "task", "method"):
        if group not in cfg:
            raise ConfigError(f"no {group} chosen; add {group}=NAME (options: {', '.join(choices(group))})")
    problems = check(RunConfig, cfg, "", facts(cfg))
    if not problems and cfg.task.get("generation"):
        problems = check(Sampling, cfg.task.generation, "task.generation")
    if not problems:
        problems = path_choice.problems(cfg, get_class(cfg.method._target_), lambda: instantiate(cfg.method))
    if problems:
        many = f"{len(problems)} problems in the config:\n  " if len(problems) > 1 else ""
        raise ConfigError(many + "\n  ".join(problems))
