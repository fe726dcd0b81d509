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
    assert "| tiny-random | Vanilla |" in table3 and "LS(E1-γ2)" in table3
    vanilla_row = next(line for line in table3.splitlines() if "| tiny-random | Vanilla |" in line)
    assert "1.00" in vanilla_row
    assert all(p.stat().st_size > 0 for p in written)


def test_report_without_a_vanilla_partner_says_so(run_cfg, tmp_path):
    runs = tmp_path / "runs"
    runner.run(run_cfg("method=ls", "method.exit_layer=1", "method.gamma=2", "limit=1", f"out_dir={runs / 'ls'}"))
    write_report([runs], out_tables=tmp_path / "tables", out_figures=None)
    assert "no vanilla" in (tmp_path / "tables" / "table3.md").read_text()
