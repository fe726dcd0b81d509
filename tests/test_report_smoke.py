"""The report reads real run records end to end (tiny model): tables and figures are written, and a
speedup is only ever paired with a Vanilla run."""

from del_bench import runner
from del_bench.report.build import write_report


def test_report_from_real_records(run_cfg, tmp_path):
    runs = tmp_path / "runs"
    runner.run(run_cfg("method=vanilla", "limit=2", f"out_dir={runs / 'vanilla'}"))
    runner.run(run_cfg("method=ls", "method.exit_layer=1", "method.gamma=2", "limit=2", f"out_dir={runs / 'ls'}"))
    written = write_report([runs], out_tables=tmp_path / "tables", out_figures=tmp_path / "figures")
    table3 = (tmp_path / "tables" / "table3.md").read_text()
    # (" ‡" after the label where this shared machine was busy around a sample: records.overloaded)
    assert "| tiny-random | Vanilla" in table3 and "LS(E1-γ2)" in table3
    vanilla_row = next(line for line in table3.splitlines() if "| tiny-random | Vanilla" in line)
    assert "1.00" in vanilla_row
    assert all(p.stat().st_size > 0 for p in written)


def test_report_without_a_vanilla_partner_says_so(run_cfg, tmp_path):
    runs = tmp_path / "runs"
    runner.run(run_cfg("method=ls", "method.exit_layer=1", "method.gamma=2", "limit=1", f"out_dir={runs / 'ls'}"))
    write_report([runs], out_tables=tmp_path / "tables", out_figures=None)
    assert "no vanilla" in (tmp_path / "tables" / "table3.md").read_text()


def test_runs_of_other_weights_are_another_model(run_cfg, tmp_path):
    """A local model retrained at the same path: its runs record another model.weights and the report keeps them
    apart (no speedup against the old weights' Vanilla, no mean over both)."""
    from del_bench.report.collect import load_runs

    runs = tmp_path / "runs"
    runner.run(run_cfg("method=vanilla", "limit=1", "+model.weights=aaaa1111", f"out_dir={runs / 'old-vanilla'}"))
    runner.run(run_cfg("method=ls", "method.exit_layer=1", "method.gamma=2", "limit=1", "+model.weights=bbbb2222",
                       f"out_dir={runs / 'new-ls'}"))
    df = load_runs([runs]).set_index("method")
    assert (df.loc["vanilla", "model"], df.loc["ls", "model"]) == ("tiny-random@aaaa1111", "tiny-random@bbbb2222")
    assert not df.loc["ls", "has_vanilla"]
