"""The GPU table: `make gpu-check`'s bench on a synthetic Llama-2-7B (results/reference/gpu/bench_gpu_7b.json) beside
the paper's Table 1 for LLaMA-2-7B (its overall speed and speedup, 1× A100-40GB).

    gpu_table(path)          a Table (render.py's machinery), or None where the result file is missing
    write_gpu(out, path)     results/tables/gpu.{md,tex}, only where the result file is there

Our rows are the bench's (one per method and path: eager, unfused CUDA graphs, fused graphs), each cell from the
result file, which its rows' records computed (`bench gpu`: harness.table, with_figures — the records themselves
stayed on the lent device). The paper's rows are its Table 1 overall figures. A synthetic model is not a LayerSkip
checkpoint: its rows compare what each method's drafting pays at a real layer's cost at a calibrated agreement, not
the checkpoint's speedups (section "Synthetic early-exit models" of the README).
"""

from __future__ import annotations

import json
from pathlib import Path

from . import tables
from .collect import REFERENCE_ROOT
from .render import Cell, Table, TableRow, write_table

RESULT = Path(REFERENCE_ROOT) / "gpu" / "bench_gpu_7b.json"  # relative to the repository, as make tables runs
COLUMNS = [("tokens_per_s", "Speed"), ("speedup", "Speedup"), ("etpl", "eTPL"), ("token_acceptance", "acc/token"),
           ("bytes_predicted_speedup", "Predicted"), ("measured_over_bytes_predicted", "Meas/pred"),
           ("host_reads_per_round", "Reads/round")]
DIGITS = {"etpl": 3}
PAPER_METHODS = [("vanilla", "", ""), ("ls", "7", "6"), ("fs", "7", "6"), ("dv", "7", ""), ("del", "", "")]


def gpu_table(path: Path = RESULT) -> Table | None:
    if not path.is_file():
        return None
    result = json.loads(path.read_text())
    device = result["provenance"].get("device", "GPU")
    synthetic = result.get("synthetic") or {}
    block = ("gpu", device)
    ours = [TableRow(block, result["model"], r["row"], f"ours: {device}, bf16",
                {key: Cell(mean=float(r[key]), runs=1, digits=DIGITS.get(key, 2))
                 for key, _ in COLUMNS if isinstance(r.get(key), (int, float))})
            for r in result["rows"] if "failure" not in r]
    paper = [TableRow(("paper", "llama2-7b"), "llama2-7b", label, tables.paper_source("llama2-7b"), cells)
             for label, cells in _paper_rows()]
    agreement = (f" (agreement {synthetic['agreement']:.2f} at layer {synthetic['exit_layer']}, calibrated)"
                 if synthetic else "")
    notes = [f"Ours: `bench gpu` on {result['model']}{agreement}, {result['settings'].get('prompts')} random prompts × "
             f"{result['settings'].get('max_new_tokens')} new tokens, speedups against the same path's Vanilla; "
             "Predicted: the memory-bound prediction (tokens per streamed byte over Vanilla's). Paper: Table 1's "
             "overall speed and speedup for LLaMA-2-7B. A synthetic model is not a LayerSkip checkpoint: compare what "
             "drafting pays at a real layer's cost, not the checkpoints' speedups."]
    return Table("gpu", f"GPU: {result['model']} on {device} beside the paper's Table 1 (LLaMA-2-7B)", COLUMNS,
                 ours + paper, notes, marked=False)


def _paper_rows() -> list[tuple[str, dict[str, Cell]]]:
    rows = []
    for method, exit_layer, gamma in PAPER_METHODS:
        cells = {metric: tables.paper_cell(1, "llama2-7b", "overall", method, exit_layer, gamma, metric)
                 for metric in ("tokens_per_s", "speedup")}
        label = {"vanilla": "Vanilla", "ls": "LS(E7-γ6)", "fs": "FS(E7-γ6)", "dv": "DV(E7)", "del": "DEL"}[method]
        rows.append((label, {k: v for k, v in cells.items() if v is not None}))
    return rows


def write_gpu(out_dir: str | Path = "results/tables", path: Path = RESULT) -> list[Path]:
    """gpu.md and gpu.tex where the GPU result file is; nothing otherwise."""
    table = gpu_table(path)
    return [] if table is None else write_table(table, out_dir)
