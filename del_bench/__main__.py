"""python -m del_bench {run,calibrate,ls,show,report,train-layerskip,export,train-exits,bench,lm-eval} …

  run  [-m] model=M task=T method=X [key=value …]   decode and write records (Hydra; -m sweeps)
  calibrate [-m] model=M task=T [grid.exit_layers=[…] grid.gammas=[…]]
                                                    LS (E, γ) grid search → results/calibration/<model>.yaml
  ls [GROUP | GROUP=NAME]                           models, tasks, methods, experiments, loggers and the run's
                                                    keys; a group's choices with each key's type, default, range
  show DIR [DIR …]                                  a table of runs' summary.json (speedup vs vanilla)
  report [--tables-only|--figures-only] [--exclude-busy] [--exclude-unsteady] [DIRS …]
                                                    paper tables and figures from run records (offline)
  train-layerskip [preset=P] [key=value …]          LayerSkip training (configs/train; rerun resumes)
  export specbench RUN_DIR OUT.jsonl [--model-id ID]
                                                    a run as Spec-Bench answers (its evaluation/speed.py reads them)
  train-exits model=M out_dir=D [task=T] [layers=[…]]
                                                    exit adapters for a frozen model (configs/train/exits.yaml)
  bench [NAME [ARGS …]]                             the benchmarks (bare: list them; NAME --help: its arguments)
  lm-eval [--model_args model=M,method=X,…] --tasks T [lm-eval's options …]
                                                    lm-evaluation-harness with --model del_bench (extra `lm-eval`)
  lm-eval crosscheck RESULTS.json [--ours RUN_DIR …] our GSM8K/HumanEval scoring of lm-eval's outputs
"""

from __future__ import annotations

import json
import logging
import sys
import warnings
from pathlib import Path

from del_bench.config import (
    ALIASES,
    CONFIG_DIR,
    GROUPS,
    KEY_GROUPS,
    check_choice,
    check_overrides,
    choices,
    compose_checked,
    describe,
    described_keys,
    did_you_mean,
    resolve_aliases,
)
from del_bench.errors import CalibrationError, ConfigError, RunConflict, TaskError
from del_bench.git_state import code_state

USER_ERRORS = (ConfigError, RunConflict, TaskError)  # reported in one line, exit code 2


def _hydra_command(argv: list[str], config_name: str, body) -> int:
    """Run `body(cfg)` as a Hydra app (-m sweeps, launchers). In a multirun a failing job is recorded and the
    sweep goes on (del_bench/jobs.py); the exit code is 1 if any job failed."""
    import hydra
    from omegaconf import DictConfig

    from del_bench import jobs

    # configs/hydra/launcher/joblib.yaml replaces the plugin's config of that name on purpose (n_jobs=1)
    warnings.filterwarnings("ignore", message=r"\s*'hydra/launcher/joblib' is validated against ConfigStore schema")
    argv = resolve_aliases(argv)  # task=cnndm → task=cnndm_sum: Hydra, the records and out_dir see the canonical name
    overrides = [a for a in argv if not a.startswith("-")]
    if overrides == argv:  # one run: every key checked before Hydra starts it (a sweep's jobs: each as it starts)
        compose_checked(config_name, argv)
    else:
        check_overrides(overrides)

    @hydra.main(config_path=str(CONFIG_DIR), config_name=config_name, version_base="1.3")
    def _main(cfg: DictConfig) -> None:
        try:
            body(cfg)
        except USER_ERRORS as err:
            logging.getLogger("del_bench").error("%s", err)
            raise SystemExit(2) from None
        except CalibrationError as err:
            logging.getLogger("del_bench").error("%s", err)
            raise SystemExit(1) from None

    jobs.FAILED.clear()
    sys.argv = [sys.argv[0], *argv]
    _main()
    return 1 if jobs.FAILED else 0


def cmd_run(argv: list[str]) -> int:
    def body(cfg) -> None:
        from del_bench import jobs

        status, summary = jobs.job(cfg, lambda: jobs.run_once(cfg), lambda: cfg.out_dir)
        if summary:
            print(format_table([summary]))
            print(f"records: {cfg.out_dir}" + (" (already finished: skipped)" if status == "skipped" else ""))

    return _hydra_command(argv, "run", body)


def cmd_calibrate(argv: list[str]) -> int:
    def body(cfg) -> None:
        from del_bench import jobs
        from del_bench.calibration import calibrate

        def work():
            try:
                return "ok", calibrate(cfg)
            except Exception as err:
                jobs.write_error(Path(cfg.calibration.dir), err, cfg)
                raise

        status, entry = jobs.job(cfg, work, lambda: cfg.calibration.dir)
        if entry:
            print(f"best LS(E{entry['exit_layer']}, γ{entry['gamma']}) for {cfg.model.name}/{cfg.task.name}: "
                  f"{entry['tokens_per_s']:.2f} tok/s ({entry['speedup'] or 0:.2f}x vanilla) → {cfg.calibration.file}")

    return _hydra_command(argv, "calibrate", body)


def cmd_ls(argv: list[str]) -> int:
    """`ls`: every group's choices, then the run's own keys; `ls GROUP`: its choices, each with its keys (model, task,
    method, logger); `ls GROUP=NAME`: one choice's keys. A key: what it accepts, its default, what it means."""
    if not argv:
        for group in GROUPS:
            _list_choices(group)
        print("run keys (key=value on the command line; `ls GROUP` or `ls GROUP=NAME`: a group's keys):")
        print("\n".join(_key_lines(described_keys())))
        return 0
    group, _, name = argv[0].partition("=")
    if group not in GROUPS:
        raise ConfigError(f"ls: {group!r} is not a config group.{did_you_mean(group, GROUPS)} Groups: "
                          f"{', '.join(GROUPS)}")
    if name:
        check_choice(group, name)
    names = [name] if name else choices(group)
    if group not in KEY_GROUPS:  # experiments, scales, data, rows set run keys: their files say which
        _list_choices(group, names)
        return 0
    for choice in names:
        print(f"{group} {choice}: {describe(group, choice)}")
        print("\n".join(_key_lines(described_keys(group, choice))))
    return 0


def _list_choices(group: str, names: list[str] | None = None) -> None:
    print(f"{group}:")
    for name in names or choices(group):
        print(f"  {name:<22} {describe(group, name)}")
    for alias, name in ALIASES.get(group, {}).items() if names is None else ():
        print(f"  {alias:<22} = {name} (an alias: recorded as {name})")


def _key_lines(rows: list[tuple[str, str, str, str]]) -> list[str]:
    """Two lines a key: its name, what it accepts and its default; then what it means."""
    width = max(len(k) for k, *_ in rows)
    lines = []
    for name, accepts, default, meaning in rows:
        lines.append(f"  {name:<{width}}  {accepts}; default {default}")
        if meaning:
            lines.append(f"  {'':<{width}}    {meaning}")
    return lines


def format_table(summaries: list[dict], keys: list | None = None) -> str:
    """Speed, speedup (vs the mean speed of the Vanilla summaries among them that it pairs with:
    records.vanilla_baseline, the report's rule), eTPL, α, the decoder-layer loop that ran (fused | eager: a failed
    fused build shows here); methods labelled as the tables label them (RunKey.label; a note names the full tags
    where two labels coincide; a batched run's label says B=…); then notes: runs timed on a busy machine (`*`,
    records.overloaded), runs not timed at steady state (`~`, records.steady_state), batched runs' throughput over the
    batch, and runs that drafted nothing (why their α is '-'). A speedup carries its Vanilla partners' marks too."""
    from del_bench.records import (
        DRIFT_LIMIT,
        PEER_MARK,
        PEER_NOTE,
        drifted,
        is_peer,
        machine_probe,
        run_key_of,
        vanilla_baseline,
        vanilla_partners,
    )

    keys = keys or [run_key_of(s) for s in summaries]
    labels, tag_notes = _show_labels(keys)
    width = max([16] + [len(label) for label in labels])
    header = (f"{'model':<14} {'task':<10} {'method':<{width}} {'n':>3} {'tok/s':>9} {'speedup':>10} {'eTPL':>6}"
              f" {'α':>5} {'layers':<6}  quality")
    lines, notes = [header, "-" * len(header)], []
    runs = list(zip(keys, summaries))
    for s, key, label in zip(summaries, keys, labels):
        base = vanilla_baseline(key, runs)
        loaded, unsteady = _busy(s), _unsteady(s)
        speedup = f"{s['tokens_per_s'] / base:.2f}x" if base and s["tokens_per_s"] else "n/a"
        partners = vanilla_partners(key, runs)
        moved = drifted(machine_probe(s.get("setup") or []), [machine_probe(p.get("setup") or []) for p in partners])
        speedup += f"{_marks([s, *partners]) + ('§' if moved else ''):<2}"  # either side busy or unsteady; drifted
        alpha = f"{s['acceptance_rate']:.2f}" if s["acceptance_rate"] is not None else "-"
        quality = " ".join(f"{k}={v:.3g}" for k, v in s.get("quality", {}).items() if not k.startswith("bleu_"))
        loop = s.get("provenance", {}).get("layer_path") or "eager"  # records from before the fused loop: eager
        lines.append(f"{s['model']:<14} {s['task']:<10} {label:<{width}} {s['n_samples']:>3} "
                     f"{s['tokens_per_s'] or 0:>7.2f}{_marks([s]):<2} {speedup:>10} {s['etpl'] or 0:>6.3f} "
                     f"{alpha:>5} {loop:<6}  {quality}")
        if loaded:
            notes.append(f"* {label} on {s['model']}/{s['task']}: timed on a busy machine — around "
                         f"{loaded['overloaded']} of {loaded['samples']} samples other processes ran on (or waited "
                         f"for) up to {loaded['max_other_cores']:.1f} CPUs where torch's threads left "
                         f"{loaded['free_cores']} free; its speed and the speedups against it are not to be trusted "
                         "(rerun on a quiet machine).")
        if unsteady:
            notes.append(f"~ {label} on {s['model']}/{s['task']}: not timed at steady state — "
                         f"{_why_unsteady(unsteady)}; its speed and the speedups against it are not to be trusted "
                         "(rerun with warmup=steady).")
        if moved:
            notes.append(f"§ {label} on {s['model']}/{s['task']}: its speedup pairs two states of the machine — the "
                         f"matrix products' probe (records.machine_probe) took more than {DRIFT_LIMIT:g}× as long in "
                         "one as in the other; re-measure it together with its Vanilla.")
        if key.batch_size != 1 and s.get("throughput"):
            base = vanilla_baseline(key, runs, "throughput")
            versus = f", {s['throughput'] / base:.2f}x Vanilla's at B={key.batch_size}" if base else ""
            notes.append(f"{label} on {s['model']}/{s['task']}: {key.batch_size} prompts decoded together — its tok/s "
                         f"is a prompt's (its tokens ÷ its latency, waiting for the batch included); over the batch "
                         f"{s['throughput']:.2f} tok/s{versus}, {s['batch_etpl']:.3f} tokens per layer the batch "
                         "loaded.")
        if s["method"] != "vanilla" and not is_peer(s["method"]) and not s.get("drafted"):
            notes.append(f"{label} drafted no token on {s['model']}: its policy never expected an early "
                         "exit to pay on this model, so every round was a full pass (eTPL = 1/L, α '-'), as Vanilla's.")
    peers = [PEER_NOTE] if any(PEER_MARK in label for label in labels) else []  # transformers' rows (bench peer)
    return "\n".join(lines + tag_notes + notes + peers)


def _busy(summary: dict) -> dict | None:
    """The run's load summary when some of its samples were timed on an overloaded machine, else None."""
    load = summary.get("load")
    return load if load and load.get("overloaded") else None


def _unsteady(summary: dict) -> dict | None:
    """The run's steady_state when it was not timed at steady state (records.steady_state), else None."""
    from del_bench.records import unsteady

    state = summary.get("steady_state")
    return state if unsteady(state) else None


def _marks(summaries: list[dict]) -> str:
    """'*' when one of these runs was timed on a busy machine, '~' when one was not at steady state (both: '*~')."""
    return "*" * any(map(_busy, summaries)) + "~" * any(map(_unsteady, summaries))


def _why_unsteady(state: dict) -> str:
    """What records.steady_state found, in words."""
    from del_bench.records import STEADY_SLOWDOWN

    why = []
    if state["warmups_unconverged"]:
        why.append(f"the warm-up of {state['warmups_unconverged']} session(s) did not converge")
    lead = state.get("lead_slowdown", state["first_slowdown"])  # records from before lead_slowdown: the first's
    if lead is not None and lead > STEADY_SLOWDOWN:
        why.append(f"one of its first two timed samples took {lead:.1f}× the median decode time per loaded layer of "
                   f"the samples after it (more than {STEADY_SLOWDOWN:g}×)")
    return " and ".join(why)


def _show_labels(keys: list) -> tuple[list[str], list[str]]:
    """Each run's method as the tables label it (RunKey.label: `DEL`, `LS(E4-γ4)`); runs whose labels coincide but
    whose tags differ (`del` and `del_cpu` are both DEL) are numbered, and a note names each numbered full tag."""
    tags: dict[str, set[str]] = {}
    for key in keys:
        tags.setdefault(key.label(), set()).add(key.method_tag)
    numbers: dict[str, int] = {}
    labels = []
    for key in keys:
        if len(tags[key.label()]) == 1:
            labels.append(key.label())
            continue
        number = numbers.setdefault(key.method_tag, len(numbers) + 1)
        labels.append(f"{key.label()} [{number}]")
    return labels, [f"[{n}] = {tag}" for tag, n in numbers.items()]


def cmd_show(argv: list[str]) -> int:
    from del_bench.records import load_summary, read_jsonl, run_key_of, steady_state

    paths = [Path(a) / "summary.json" if Path(a).is_dir() else Path(a) for a in argv]
    missing = [str(p) for p in paths if not p.is_file()]
    if not paths or missing:
        print(f"show: give run directories holding summary.json (missing: {', '.join(missing) or 'none given'})",
              file=sys.stderr)
        return 2
    summaries = [json.loads(p.read_text()) for p in paths]
    samples = [read_jsonl(p.parent / "samples.jsonl") for p in paths]
    keys = [run_key_of(s, rows) for s, rows in zip(summaries, samples)]
    for path, summary, rows in zip(paths, summaries, samples):  # judged again from the records: today's rules
        summary["load"] = load_summary(rows) if rows else summary.get("load")
        if rows:
            summary["steady_state"] = steady_state(rows, read_jsonl(path.parent / "rounds.jsonl"),
                                                   read_jsonl(path.parent / "setup.jsonl"))
    print(format_table(summaries, keys))
    return 0


def cmd_report(argv: list[str]) -> int:
    from del_bench.report.build import cli

    return cli(argv)


def _train_command(argv: list[str], config_name: str, module: str, done) -> int:
    """A training command (configs/train/<config_name>.yaml): Hydra parses argv, `<module>.train(cfg)` trains
    (rerun resumes) and `done(cfg, out)` says what came out; a ConfigError exits 2 before anything loads."""
    import importlib

    import hydra
    from omegaconf import DictConfig

    @hydra.main(config_path=str(CONFIG_DIR / "train"), config_name=config_name, version_base="1.3")
    def _main(cfg: DictConfig) -> None:
        try:
            out = importlib.import_module(module).train(cfg)
        except ConfigError as err:
            logging.getLogger("del_bench").error("%s", err)
            raise SystemExit(2) from None
        print(done(cfg, out))

    sys.argv = [sys.argv[0], *argv]
    _main()
    return 0


def cmd_train_layerskip(argv: list[str]) -> int:
    return _train_command(argv, "layerskip", "del_bench.train.trainer", lambda cfg, out: f"model: {out}" if out else
                          f"stopped at step {cfg.stop_at}; rerun without stop_at to resume")


def cmd_export(argv: list[str]) -> int:
    """`export specbench RUN_DIR OUT.jsonl [--model-id ID]` (del_bench/specbench.py: the layout and mapping)."""
    args = list(argv)
    model_id = None
    if "--model-id" in args:
        i = args.index("--model-id")
        if i + 1 >= len(args):
            print("export: --model-id needs a value", file=sys.stderr)
            return 2
        model_id = args[i + 1]
        del args[i:i + 2]
    if len(args) != 3 or args[0] != "specbench":
        print("usage: python -m del_bench export specbench RUN_DIR OUT.jsonl [--model-id ID]", file=sys.stderr)
        return 2
    from del_bench import specbench

    _, run_dir, out = args
    try:
        count = specbench.export(run_dir, out, model_id)
    except (FileNotFoundError, ValueError) as err:
        print(f"export: {err}", file=sys.stderr)
        return 2
    print(f"{out}: {count} questions")
    return 0


def cmd_train_exits(argv: list[str]) -> int:
    return _train_command(argv, "exits", "del_bench.train.exits",
                          lambda cfg, out: f"exit adapters: {out} (use: model.exit_adapters={out})")


def cmd_lm_eval(argv: list[str]) -> int:
    """lm-eval's CLI with our model registered (del_bench/lm_eval_backend.py); `lm-eval crosscheck RESULTS.json …`:
    our task files' scoring of its outputs (del_bench/lm_eval_crosscheck.py). lm-eval is an optional dependency."""
    try:
        from del_bench import lm_eval_backend, lm_eval_crosscheck
    except ModuleNotFoundError as err:
        if err.name and err.name.split(".")[0] == "lm_eval":
            print("lm-eval: lm-evaluation-harness is not installed; it is the optional extra `lm-eval`: "
                  "pip install -e '.[lm-eval]' -c constraints.txt (make setup installs it)", file=sys.stderr)
            return 2
        raise
    try:
        if argv and argv[0] == "crosscheck":
            return lm_eval_crosscheck.main(argv[1:])
        return lm_eval_backend.cli(argv)
    except USER_ERRORS as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def cmd_bench(argv: list[str]) -> int:
    from del_bench.bench import main

    return main(argv)


COMMANDS = {"run": cmd_run, "calibrate": cmd_calibrate, "ls": cmd_ls, "show": cmd_show, "report": cmd_report,
            "train-layerskip": cmd_train_layerskip, "export": cmd_export, "train-exits": cmd_train_exits,
            "bench": cmd_bench, "lm-eval": cmd_lm_eval}


MEASURING = ("run", "calibrate", "train-layerskip", "train-exits", "bench", "lm-eval")  # commands that write records


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    command = sys.argv[1]
    if command in MEASURING:
        code_state()  # the code this process measures with, before a model loads (provenance; git_state)
    try:
        return COMMANDS[command](sys.argv[2:])
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
