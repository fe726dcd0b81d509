"""The run config as a schema (del_bench/schema.py): every key typed and ranged before a model loads.

A bad value on the command line is answered through the CLI's own entry with exit status 2 and one line that names
the key, the value and what is allowed (for a name, what was probably meant) — no traceback, no weights loaded. Every
config of configs/ validates; each class's declared defaults are its constructor's; `ls` and the README's table of
keys say what each key accepts, from the same declarations."""

from __future__ import annotations

import dataclasses
import inspect
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from hydra.utils import get_class
from omegaconf import OmegaConf

from del_bench import __main__ as cli
from del_bench import config, session
from del_bench.config import RunConfig, choices, keys_table, validate
from del_bench.engine import compiled
from del_bench.errors import ConfigError
from del_bench.methods import method_class
from del_bench.methods.base import REGISTRY
from del_bench.models import loading
from tests.conftest import compose_run

README = Path(__file__).resolve().parent.parent / "README.md"
# every method class of del_bench (a name none has makes method_class import them all, the peers' too)
assert method_class("no method has this name") is None
METHOD_CLASSES = sorted({c for c in REGISTRY.values() if c.__module__.startswith("del_bench.")}, key=lambda c: c.name)

# (the command line after `run model=tiny-random`, what the one line of error must say): each a different key or rule
BAD = {
    "dtype": ("model.dtype=float8", "model.dtype='float8': must be one of float32, float64, float16, bfloat16 — "),
    "device": ("model.device=tpu", "model.device='tpu': must be cpu, cuda or cuda:N, or null — "),
    "seed": ("seed=x", "seed='x': must be an integer ≥ 0 — "),
    "temperature": ("generation.temperature=-1", "generation.temperature=-1: must be a number > 0 — "),
    "ls-gamma": ("method=ls method.gamma=0", "method.gamma=0: must be an integer ≥ 1 — "),
    "threads": ("threads=0", "threads=0: must be an integer ≥ 1, or null — "),
    "batch_size": ("batch_size=0", "batch_size=0: must be an integer ≥ 1 — "),
    "compile": ("compile=maybe", "compile='maybe': must be one of off, auto, on, graphs — "),
    "warmup": ("warmup=stedy", "warmup='stedy': must be one of auto, quick, steady, off — the untimed warm-up"),
    "limit": ("limit=-1", "limit=-1: must be an integer ≥ 1, or null — "),
    "max_new_tokens": ("max_new_tokens=0", "max_new_tokens=0: must be an integer ≥ 1 — "),
    "exit_layer": ("method=ls method.exit_layer=99", "method.exit_layer=99: must be an integer in [1, L − 1], here "
                   "[1, 3] (L = 4) — "),
    "top_p": ("generation.top_p=1.5", "generation.top_p=1.5: must be a number in (0, 1] — "),
    "do_sample": ("generation.do_sample=maybe", "generation.do_sample='maybe': must be true or false — "),
    "data_files": ("task=prompts", "task.data_files: missing — give task.data_files=…: a JSONL file"),
    "layers": ("layers=fusd", "layers='fusd': must be one of auto, fused, eager — "),
    "products": ("products=wt", "products='wt': must be one of auto, wt_x, x_wt — "),
    "warmup_passes": ("warmup_passes=1", "warmup_passes=1: must be an integer ≥ 2 — "),
    "warmup_tolerance": ("warmup_tolerance=1.5", "warmup_tolerance=1.5: must be a number in (0, 1) — "),
    "unknown-key": ("method=ls method.gama=2", "method.gama: not a key of method ls. Did you mean 'gamma'"),
    "unknown-appended": ("+seeed=3", "seeed: not a key of the run config. Did you mean 'seed'?"),
    "missing-path": ("model=local", "model.path: missing — give model.path=…: a save_pretrained directory"),
    "num_layers": ("model.num_layers=x", "model.num_layers='x': must be an integer ≥ 1 — "),
    "heads": ("model.num_heads=3 model.num_kv_heads=1", "model.hidden_size=64 must be a multiple of model.num_heads=3"),
    "dv-theta": ("method=dv method.theta=1.5", "method.theta=1.5: must be a number in [0, 1] — "),
    "swift-ratio": ("method=swift method.skip_ratio=0", "method.skip_ratio=0: must be a number in (0, 1) — "),
    "del-omega": ("method=del method.omega=2", "method.omega=2: must be a number in [0, 1] — "),
    "fs-floor": ("method=fs method.floor=2", "method.floor=2: must be one of 0, 1 — "),
    "knapspec-contexts": ("method=knapspec method.latency_contexts=[64]", "method.latency_contexts=[64] needs ≥ 2 "
                          "distinct positive context lengths"),
    "timeout": ("task.timeout=0", "task.timeout=0: must be a number > 0 — "),
    "samples_per_prompt": ("task.samples_per_prompt=0", "task.samples_per_prompt=0: must be an integer ≥ 1 — "),
    "task-unknown-key": ("+task.timout=2", "task.timout: not a key of task humaneval. Did you mean 'timeout'?"),
    "sandbox": ("task.sandbox.mode=bwarp", "task.sandbox.mode='bwarp': must be one of auto, bwrap, fallback — "),
    "task-generation": ("task=humaneval_pass10 task.generation.temperature=0",
                        "task.generation.temperature=0: must be a number > 0 — "),
    "logger": ("logger=wandb logger.mode=onlin", "logger.mode='onlin': must be one of online, offline, disabled, auto"),
    "batch-compile": ("method=adadecode batch_size=2 compile=on",
                      "compile=on: a batch of method=adadecode cannot run on graphs"),
    "method-name": ("method=lss", "unknown method 'lss'. Did you mean 'ls'"),
    "parse": ("limit=[1,", "no viable alternative at input '[1,'"),
}
# what was probably meant, where a name was mistyped
GUESSES = {"dtype": "Did you mean 'float64' or 'float32' or 'float16'?", "warmup": "Did you mean 'steady'?",
           "layers": "Did you mean 'fused'?", "products": "Did you mean 'x_wt' or 'wt_x'?",
           "sandbox": "Did you mean 'bwrap'?", "logger": "Did you mean 'online' or 'offline'?"}


@pytest.fixture
def no_weights(monkeypatch):
    def refuse(*_, **__):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(loading, "load", refuse)
    monkeypatch.setattr(session, "load_model", refuse)


def run_cli(monkeypatch, capsys, *args: str) -> tuple[int, str]:
    """`python -m del_bench run …` through the CLI's entry, in this process: (exit status, stderr)."""
    monkeypatch.setattr(sys, "argv", ["del_bench", "run", *args])
    return cli.main(), capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_bad_value_exits_2_with_one_line_naming_it(name, no_weights, monkeypatch, capsys, tmp_path):
    line, message = BAD[name]
    status, err = run_cli(monkeypatch, capsys, "model=tiny-random", f"out_dir={tmp_path / 'run'}", *line.split())
    assert status == 2
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
    assert message in err, err
    assert GUESSES.get(name, "") in err
    assert not (tmp_path / "run").exists()  # checked before Hydra starts the job: no out_dir made


def test_the_issues_bad_values_exit_2_from_a_real_process():
    """The command as a new user types it (the LayerSkip-trained testbed), in a process of its own."""
    done = subprocess.run([sys.executable, "-m", "del_bench", "run", "model=testbed", "model.dtype=float8"],
                          capture_output=True, text=True)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("error: model.dtype='float8': must be one of") and done.stderr.count("\n") == 1


def test_every_bad_key_is_named_together(no_weights, monkeypatch, capsys):
    status, err = run_cli(monkeypatch, capsys, "model=tiny-random", "seed=x", "threads=0", "method=ls",
                          "method.gamma=0")
    assert status == 2 and err.startswith("error: 3 problems in the config:")
    assert [line.split(":")[0].strip() for line in err.splitlines()[1:]] == ["method.gamma=0", "seed='x'", "threads=0"]


def test_keys_that_fail_to_resolve_for_one_reason_are_named_once(tmp_path):
    cfg = compose_run("model=tiny-random", "method=ls", "calibration.use=true", f"calibration.file={tmp_path}/c.yaml")
    with pytest.raises(ConfigError) as refused:
        validate(cfg)
    assert str(refused.value).startswith("method.tag, method.exit_layer, method.gamma, out_dir: cannot be resolved: "
                                         f"calibration.use=true but {tmp_path}/c.yaml has no entry for task")


def test_a_key_its_config_leaves_out_is_added_with_a_plus(monkeypatch, capsys):
    status, err = run_cli(monkeypatch, capsys, "model=tiny-random", "method=del", "method.lookahead=2")
    assert status == 2 and "method.lookahead: method del does not set it; add it with +method.lookahead=…" in err


def test_compile_choices_follow_the_compiled_steps(monkeypatch):
    """A choice engine/compiled.py adds is a choice of `compile` (no copy of the list here)."""
    cfg = compose_run("model=tiny-random", "compile=graphs2")
    with pytest.raises(ConfigError, match="compile='graphs2': must be one of off, auto, on, graphs "):
        validate(cfg)
    monkeypatch.setattr(compiled, "COMPILE_CHOICES", (*compiled.COMPILE_CHOICES, "graphs2"))
    validate(cfg)


@pytest.mark.parametrize("group", ["model", "task", "method", "logger"])
def test_every_config_of_a_group_composes_and_validates(group):
    for name in choices(group):
        extra = {"local": ["model.path=results/testbed"], "prompts": ["task.data_files=mine.jsonl"]}.get(name, [])
        validate(compose_run(f"{group}={name}", *extra))  # on the default model, SmolLM2's 30 layers


def _constructor_defaults(cls) -> dict:
    """Every parameter an __init__ of the class (and its bases) takes by name, with its default (Parameter.empty:
    none; a subclass's over its base's)."""
    out = {}
    for klass in reversed(cls.__mro__):
        if "__init__" in vars(klass):
            for p in inspect.signature(klass.__init__).parameters.values():
                if p.kind is p.POSITIONAL_OR_KEYWORD and p.name != "self":
                    out[p.name] = p.default
    return out


@pytest.mark.parametrize("cls", METHOD_CLASSES, ids=lambda c: c.name)
def test_a_method_declares_every_hyperparameter_with_its_constructors_default(cls):
    _same_keys_and_defaults(cls, cls.config)


def test_every_task_declares_every_key_with_its_constructors_default():
    classes = {get_class(OmegaConf.load(config.CONFIG_DIR / "task" / f"{n}.yaml")._target_) for n in choices("task")}
    for cls in classes:
        _same_keys_and_defaults(cls, cls.config)


def _same_keys_and_defaults(cls, schema):
    declared = {f.name: f for f in dataclasses.fields(schema)}
    for name, default in _constructor_defaults(cls).items():
        assert name in declared, f"{cls.__name__}({name}=…) takes a key its config does not declare"
        field = declared[name]
        if default is inspect.Parameter.empty or default is None and field.default is dataclasses.MISSING:
            continue
        value = field.default if field.default_factory is dataclasses.MISSING else field.default_factory()
        assert list(default) == value if isinstance(default, tuple) else default == value, (cls.__name__, name)


def test_ls_shows_each_keys_type_default_and_range(capsys):
    assert cli.cmd_ls(["method=ls"]) == 0
    out = capsys.readouterr().out
    assert "  gamma       an integer ≥ 1; default ${calibrated:gamma,${model.default_gamma}}\n" in out
    assert "  exit_layer  an integer in [1, L − 1]; default" in out
    assert cli.cmd_ls(["model=tiny-random"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"\n  dtype +one of float32, float64, float16, bfloat16; default float64\n", out)
    assert cli.cmd_ls([]) == 0
    out = capsys.readouterr().out
    assert re.search(r"\n  seed +an integer ≥ 0; default 42\n +the sample draw's", out) and "\nmethod:\n" in out
    with pytest.raises(ConfigError, match="unknown method 'lss'"):
        cli.cmd_ls(["method=lss"])


def test_the_readme_lists_every_run_key_with_what_it_accepts():
    table = keys_table()
    assert table in README.read_text(), "README's table of run keys is not config.keys_table(): paste it in"
    documented = {row.split("`")[1] for row in table.splitlines()[2:]}
    nested = {"generation", "calibration", "scale", "grid"}
    assert {f for f in RunConfig.__dataclass_fields__ if f not in config.KEY_GROUPS and f not in nested} <= documented


def test_the_run_schemas_defaults_are_run_yamls():
    written = OmegaConf.to_container(OmegaConf.load(config.CONFIG_DIR / "run.yaml"), resolve=False)

    def same(schema, values, where=""):
        for field in dataclasses.fields(schema):
            if field.name not in values or field.name in config.KEY_GROUPS:
                continue
            inner = typing.get_type_hints(schema)[field.name]
            nested = next((a for a in typing.get_args(inner) if dataclasses.is_dataclass(a)), None)
            if nested is not None and isinstance(values[field.name], dict):
                same(nested, values[field.name], f"{where}{field.name}.")
            elif field.default is not dataclasses.MISSING:
                assert field.default == values[field.name], f"{where}{field.name}"

    same(RunConfig, written)
