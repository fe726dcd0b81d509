"""notebooks/report.ipynb cannot silently rot: its code cells run, in order, against the golden mini-records
(no Jupyter needed: the cells are read from the .ipynb JSON and exec'd), and it is committed without outputs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import matplotlib.pyplot as plt

from del_bench.report import tables
from tests.data.report_golden.records import write_records

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "report.ipynb"


def _code_cells() -> list[dict]:
    nb = json.loads(NOTEBOOK.read_text())
    assert nb["nbformat"] == 4
    return [c for c in nb["cells"] if c["cell_type"] == "code"]


def test_notebook_is_committed_without_outputs():
    for cell in _code_cells():
        assert cell["outputs"] == [] and cell["execution_count"] is None, "clear the notebook's outputs"


def test_notebook_code_runs_on_records(tmp_path, monkeypatch):
    runs = write_records(tmp_path / "all")
    records = tmp_path / "records"
    for task in ("humaneval", "cnndm_lm"):  # a small set: one model, an LS grid, Vanilla partners
        shutil.copytree(runs / "smollm2-135m" / task, records / "smollm2-135m" / task)
    monkeypatch.setenv("DEL_BENCH_REPORT_ROOTS", str(records))
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__main__"}
    for i, cell in enumerate(_code_cells()):
        exec(compile("".join(cell["source"]), f"{NOTEBOOK.name}[code cell {i}]", "exec"), namespace)
    try:
        assert len(namespace["df"]) == len(list(records.rglob("summary.json")))
        assert isinstance(namespace["t3"], tables.Table) and any(r.label == "LS(E20-γ4)" for r in namespace["t3"].rows)
        fig = namespace["fig"]
        assert isinstance(fig, plt.Figure)
        assert {(ax.get_xlabel(), ax.get_ylabel()) for ax in fig.axes} == {("γ (draft length)", "Exit layer E")}
    finally:
        plt.close("all")
