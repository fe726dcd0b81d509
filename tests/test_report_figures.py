"""Report figures from the golden mini-records: each builder returns a Figure with the expected axes, the
files are non-empty PNG/PDF, and building twice (from copies of the records in different places) gives
byte-identical files, so committed figures regenerate exactly."""

from __future__ import annotations

import json
import math
import shutil
import statistics
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pytest

from del_bench.report import figures
from del_bench.report.build import write_report
from del_bench.report.collect import load_rounds, load_runs


def _labels(fig: plt.Figure) -> list[tuple[str, str]]:
    return [(ax.get_xlabel(), ax.get_ylabel()) for ax in fig.axes]


def _texts(fig: plt.Figure) -> str:
    return " ".join(t.get_text() for t in fig.texts)


def test_fig1a_best_config_per_task_applied_to_every_task(df):
    smol = df[df.model == "smollm2-135m"]
    grid = figures._ls_grid(smol)
    best = figures.best_ls_configs(grid)
    assert best == {"cnndm_lm": (12.0, 2.0), "humaneval": (20.0, 4.0), "xsum": (12.0, 4.0)}
    calib = grid[(grid.sample_set == "calibration") & (grid.task == "xsum")]  # "best" = the fastest grid point
    assert calib.sort_values("tokens_per_s_mean").iloc[-1][["exit_layer", "gamma"]].tolist() == [12, 4]
    fig = figures.fig1a(smol, "smol")
    assert _labels(fig) == [("Task", "Speedup over Vanilla (×)")]
    bars = fig.axes[0].patches
    assert len(bars) == 3 * 3  # three distinct best configs × three tasks
    assert [b.get_hatch() for b in bars].count("//") == 1  # LS(E12-γ4) was not evaluated on XSUM: its grid point
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert legend == ["LS(E12-γ2): best on CNN/DM-LM", "LS(E20-γ4): best on HumanEval", "LS(E12-γ4): best on XSUM"]
    plt.close(fig)


def test_fig1b_segments_over_the_grid(df):
    runs = df[(df.model == "smollm2-135m") & (df.task == "humaneval") & (df.method == "ls")
              & (df.sample_set == "calibration")].sort_values("run_dir")
    seg = figures.grid_segments(runs)
    assert set(seg.sample_id) == {"c0", "c1"} and len(seg[["exit_layer", "gamma"]].drop_duplicates()) == 4
    # every token of a prompt lands in exactly one segment
    s0 = seg[(seg.sample_id == "c0") & (seg.exit_layer == 12) & (seg.gamma == 2)]
    assert list(s0.start) == [0, 64, 128] and list(s0.end) == [64, 128, 150]
    fig = figures.fig1b(seg, "smol")
    assert len(fig.axes) == 2 * 3
    assert set(_labels(fig)) == {("γ (draft length)", "Exit layer E")}
    assert "split evenly" in _texts(fig)
    plt.close(fig)


def test_fig3b_breakdown_by_gamma(runs_dir):
    rounds = load_rounds(next(runs_dir.glob("llama2-7b/aqua_rat/del-*/*seed42")))
    fig = figures.fig3b(rounds, "llama2-7b AQuA")
    assert _labels(fig) == [("γ (tokens drafted in the round)", "Mean time per round (ms)")]
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == ["Draft", "Verify", "Controller (policy)"]
    plt.close(fig)


def test_fig4b_band_when_recorded_and_a_note_when_not(runs_dir):
    with_band = load_rounds(next(runs_dir.glob("smollm2-135m/humaneval/del-*/*")))
    fig = figures.fig4b(with_band, "smol")
    assert _labels(fig) == [("SD round", "Confidence / τ")]
    assert len(fig.axes[0].collections) == 1 and figures.BAND_MISSING not in _texts(fig)  # the band
    plt.close(fig)
    without = load_rounds(next(runs_dir.glob("llama2-7b/humaneval/del-*/*")))
    fig = figures.fig4b(without, "llama")
    assert len(fig.axes[0].collections) == 0 and figures.BAND_MISSING in _texts(fig)
    plt.close(fig)


def test_fig4a_4c_axes(df, runs_dir):
    rounds = load_rounds(next(runs_dir.glob("smollm2-135m/humaneval/del-*/*")))
    fig = figures.fig4a({"smol HumanEval": rounds}, "cpu")
    assert _labels(fig) == [("SD round", "τ (draft-exit threshold)")]
    plt.close(fig)
    fig = figures.fig4c(rounds, "smol")
    assert _labels(fig) == [("SD round", "Chosen exit layer E"), ("", "α at the chosen exit layer")]
    plt.close(fig)


def test_build_figures_names_every_kind(df):
    smol = df[(df.model == "smollm2-135m") & ~df.method_tag.str.contains("fixed")]
    names = list(figures.build_figures(smol))
    plt.close("all")
    # 1b only from the calibration grid (max 256), although the evaluation runs (max 512) hold LS runs too
    block, run = "smollm2-135m_cpu_x86_64_2_threads_greedy", "smollm2-135m_humaneval_del-w0.95-layers-vNone"
    assert names == [
        f"fig1a_{block}", f"fig1b_{block}_max256_cnndm_lm", f"fig1b_{block}_max256_humaneval",
        f"fig1b_{block}_max256_xsum", f"fig3a_{block}_max512", f"fig3b_{block}_max512", "fig4a_cpu_x86_64_2_threads",
        f"fig4b_{run}_greedy-max512-seed42", f"fig4c_{run}_greedy-max512-seed42",
    ]


def test_fig3b_groups_del_runs_by_their_exit_layer_setting(df):
    smol = df[(df.model == "smollm2-135m") & (df.method == "del")]
    names = []
    for name, fig in figures.iter_figures(smol):
        names.append(name)
        plt.close(fig)
    names = [n for n in names if n.startswith("fig3b")]
    block = "fig3b_smollm2-135m_cpu_x86_64_2_threads_greedy_max512"
    assert names == [block, f"{block}_E20"]


def _subset(runs_dir: Path, dest: Path) -> Path:
    """A copy of the SmolLM2 HumanEval records (evaluation and calibration): bars, heatmaps, lines and bands
    (every kind of artist the figures use) in six figures, which keeps the test short."""
    for part in ("smollm2-135m/humaneval", "calibration/smollm2-135m/humaneval"):
        shutil.copytree(runs_dir / part, dest / part)
    return dest


def test_report_is_byte_identical_when_rebuilt(runs_dir, tmp_path):
    outputs = []
    for name in ("a", "b"):  # the records in two places: no absolute path may leak into the outputs
        records = _subset(runs_dir, tmp_path / name / "records")
        written = write_report([records], tmp_path / name / "tables", tmp_path / name / "figures")
        assert {p.suffix for p in written} == {".md", ".tex", ".png", ".pdf"}
        assert all(p.stat().st_size > 0 for p in written)
        outputs.append({p.relative_to(tmp_path / name): p.read_bytes() for p in written})
    assert outputs[0].keys() == outputs[1].keys()
    differ = [str(k) for k in outputs[0] if outputs[0][k] != outputs[1][k]]
    assert not differ, f"not reproducible: {differ}"
    pngs = [k for k in outputs[0] if k.suffix == ".png"]
    assert pngs and all(outputs[0][k].startswith(b"\x89PNG") for k in pngs)
    assert all(outputs[0][k].startswith(b"%PDF") for k in outputs[0] if k.suffix == ".pdf")
    assert not any(b"CreationDate" in outputs[0][k] for k in outputs[0] if k.suffix == ".pdf")


def test_stale_figures_are_pruned(tmp_path):
    """A figure whose records are gone does not linger; files that are not ours are left alone."""
    (tmp_path / "fig1a_gone_model.png").write_bytes(b"old")
    (tmp_path / "fig4b_gone_run.pdf").write_bytes(b"old")
    (tmp_path / "notes.txt").write_text("mine")
    assert figures.write_figures(load_runs([tmp_path / "no-records"]), tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


# ---- the plotted data: each array drawn equals the value recomputed here from rounds.jsonl itself (json, no pandas)

def _raw_rounds(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "rounds.jsonl").read_text().splitlines()]


def _first_output(rows: list[dict], field: str) -> list[dict]:
    """The rounds of the first output (sample_id, repeat) with `field` recorded, in file order."""
    rows = [r for r in rows if r.get(field) is not None]
    first = (rows[0]["sample_id"], rows[0]["repeat"])
    return [r for r in rows if (r["sample_id"], r["repeat"]) == first]


def _xy(artist) -> tuple[list, list]:
    return list(artist.get_xdata()), list(artist.get_ydata())


def test_fig3b_bars_are_mean_phase_times_by_gamma(runs_dir):
    run = next(runs_dir.glob("llama2-7b/aqua_rat/del-*/*seed42"))
    rows = [r for r in _raw_rounds(run) if r["round"] > 0]
    gammas = sorted({r["drafted"] for r in rows})
    by_gamma = [[r for r in rows if r["drafted"] == g] for g in gammas]
    fig = figures.fig3b(load_rounds(run), "t")
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == [str(g) for g in gammas] and len(gammas) > 3
    bottom = [0.0] * len(gammas)
    for bars, phase in zip(ax.containers, ("draft_s", "verify_s", "policy_s"), strict=True):
        means = [1000 * statistics.fmean(r[phase] for r in group) for group in by_gamma]  # ms
        assert [b.get_height() for b in bars] == pytest.approx(means, rel=1e-12)
        assert [b.get_y() for b in bars] == pytest.approx(bottom, rel=1e-12)  # stacked on the phases before
        bottom = [b + m for b, m in zip(bottom, means)]
    assert [t.get_text() for t in ax.texts] == [str(len(group)) for group in by_gamma]  # rounds per bar
    plt.close(fig)


def test_fig4a_lines_are_tau_of_each_runs_first_prompt(runs_dir):
    runs = {"smol": next(runs_dir.glob("smollm2-135m/humaneval/del-*/*")),
            "llama": next(runs_dir.glob("llama2-7b/humaneval/del-*/*"))}
    fig = figures.fig4a({label: load_rounds(run) for label, run in runs.items()}, "cpu", max_rounds=20)
    lines = fig.axes[0].get_lines()
    assert [line.get_label() for line in lines] == list(runs)
    for line, run in zip(lines, runs.values()):
        first = [r for r in _first_output(_raw_rounds(run), "tau") if r["round"] <= 20]
        assert _xy(line) == ([r["round"] for r in first], [r["tau"] for r in first])
    plt.close(fig)


def test_fig4b_band_drafts_and_tau_are_the_first_prompts_rounds(runs_dir, tmp_path):
    rows = _raw_rounds(next(runs_dir.glob("smollm2-135m/humaneval/del-*/*")))
    for r in rows:  # the golden records lack draft_confidences: one per draft, spread around τ
        if r.get("tau") is not None:
            r["draft_confidences"] = [round(r["tau"] + 0.01 * (i - r["accepted"]), 6) for i in range(r["drafted"])]
    (tmp_path / "rounds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    first = _first_output(rows, "tau")
    fig = figures.fig4b(load_rounds(tmp_path), "t")
    ax = fig.axes[0]
    band, accepted, rejected = ax.collections
    drawn = {tuple(v) for path in band.get_paths() for v in path.vertices}
    assert drawn == {(r["round"], r[k]) for r in first for k in ("conf_matched", "conf_mismatched")}
    for dots, kept in ((accepted, True), (rejected, False)):
        expected = [(r["round"], c) for r in first for i, c in enumerate(r["draft_confidences"])
                    if (i < r["accepted"]) == kept]
        assert [tuple(p) for p in dots.get_offsets()] == expected and expected
    (tau,) = ax.get_lines()
    assert _xy(tau) == ([r["round"] for r in first], [r["tau"] for r in first])
    plt.close(fig)


def test_fig4c_lines_are_the_chosen_exit_layer_and_its_alpha(runs_dir):
    run = next(runs_dir.glob("smollm2-135m/humaneval/del-*/*"))
    first = _first_output(_raw_rounds(run), "chosen_exit_layer")
    fig = figures.fig4c(load_rounds(run), "t")
    (exit_layer,), (alpha,) = fig.axes[0].get_lines(), fig.axes[1].get_lines()
    rounds = [r["round"] for r in first]
    assert _xy(exit_layer) == (rounds, [r["chosen_exit_layer"] for r in first])
    assert _xy(alpha) == (rounds, [r["alpha_exit"] for r in first])
    assert len(set(_xy(exit_layer)[1])) > 1  # E moves: a constant would not tell the columns apart
    plt.close(fig)


def _segment_speeds(rows: list[dict], size: int) -> list[float]:
    """Tokens/s per `size`-token segment of one output: each token carries its round's time ÷ its tokens."""
    seconds: list[float] = []
    for r in sorted(rows, key=lambda r: r["round"]):
        for _ in range(r["emitted"]):
            seconds.append((r["draft_s"] + r["verify_s"] + r["policy_s"]) / r["emitted"])
    segments = [seconds[i:i + size] for i in range(0, len(seconds), size)]
    return [len(seg) / sum(seg) for seg in segments]


def test_fig1b_heatmaps_are_segment_speeds_from_rounds(df, runs_dir):
    grid = runs_dir / "calibration/smollm2-135m/humaneval"
    runs = df[(df.model == "smollm2-135m") & (df.task == "humaneval") & (df.method == "ls")
              & (df.sample_set == "calibration")].sort_values("run_dir")
    fig = figures.fig1b(figures.grid_segments(runs), "t")
    es, gs = [12, 20], [2, 4]
    speeds = {}  # (prompt, E, γ) → segment tokens/s
    for e in es:
        for g in gs:
            rows = _raw_rounds(next(grid.glob(f"ls-E{e}-g{g}/*")))
            for sid in ("c0", "c1"):  # the first two prompts, sorted
                speeds[sid, e, g] = _segment_speeds([r for r in rows if r["sample_id"] == sid and r["repeat"] == 0],
                                                    figures.SEGMENT_TOKENS)
    assert len(fig.axes) == 2 * 3
    for k, ax in enumerate(fig.axes):
        sid, segment = ("c0", "c1")[k // 3], k % 3
        (image,) = ax.get_images()
        # rows E, columns γ (origin lower); c1 has 96 tokens: no third segment, a blank (masked) heatmap
        expected = [(speeds[sid, e, g] + [math.nan] * 3)[segment] for e in es for g in gs]
        drawn = np.ma.filled(image.get_array(), np.nan)
        assert drawn.shape == (len(es), len(gs))
        assert drawn.ravel().tolist() == pytest.approx(expected, rel=1e-12, nan_ok=True), (sid, segment)
    plt.close(fig)
