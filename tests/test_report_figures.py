"""Report figures from the golden mini-records: each builder returns a Figure with the expected axes, the
files are non-empty PNG/PDF, and building twice (from copies of the records in different places) gives
byte-identical files, so committed figures regenerate exactly."""

from __future__ import annotations

import shutil
from pathlib import Path

import matplotlib.pyplot as plt

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
