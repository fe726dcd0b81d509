"""Cross-check the transcription of the DEL paper's Tables 1-6.

``del_bench/report/paper_values.csv`` (the main file) holds every numeric cell
of Tables 1-6. ``tests/data/paper_values_check.csv`` is an independent second
transcription of a sample of cells. These tests check the main file's schema,
compare every sampled cell against it and check the per-table cell counts
computed from the paper's table layouts.
"""

from __future__ import annotations

import csv
import math
import re
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MAIN_CSV = REPO / "del_bench" / "report" / "paper_values.csv"
CHECK_CSV = REPO / "tests" / "data" / "paper_values_check.csv"

COLUMNS = ["table", "model", "task", "setting", "method", "exit_layer", "gamma", "metric", "value"]
KEY_COLUMNS = COLUMNS[:-1]  # every column except value (and the optional `underlined`)
OPTIONAL_COLUMNS = {"underlined"}

MODELS = {
    "llama3.2-1b", "llama3-8b", "llama2-7b", "llama2-13b", "llama2-70b",
    "codellama-7b", "codellama-34b",
}
TASKS = {
    "aqua_rat", "cnndm_lm", "cnndm_sum", "xsum", "humaneval", "gsm8k", "wmt14_de_en", "overall",
}
METHODS = {"vanilla", "ls", "fs", "dv", "del", "swift", "del_e", "del_gamma", "del_e_lim"}
METRICS = {"etpl", "speedup", "tokens_per_s", "rouge2", "gain", "memory_gb", "memory_overhead_pct"}
TRUTHY = {"", "0", "1", "true", "false", "True", "False", "yes", "no"}

LLAMA_TEXT_MODELS = ["llama3.2-1b", "llama3-8b", "llama2-7b", "llama2-13b", "llama2-70b"]

# Expected number of numeric cells per (table, model), derived from the paper's layouts.
# Cells printed as "-" (no value) are not transcribed.
EXPECTED_COUNTS: dict[tuple[int, str], int] = {}
# Table 1: 5 methods (Vanilla, LS, FS, DV, DEL) x (4 tasks x {eTPL, speedup} + overall speed + overall speedup).
for _m in LLAMA_TEXT_MODELS:
    EXPECTED_COUNTS[(1, _m)] = 5 * (4 * 2 + 2)  # 50
# Table 2: 5 methods x (pass@1 {eTPL, speedup} + pass@10 {eTPL, speedup} + ROUGE-2).
for _m in ["codellama-7b", "codellama-34b"]:
    EXPECTED_COUNTS[(2, _m)] = 5 * 5  # 25
# Table 3: 10 method rows (Vanilla, 3 LS, 3 FS, 2 DV, DEL) x 7 tasks x {speed, speedup}.
for _m in LLAMA_TEXT_MODELS:
    EXPECTED_COUNTS[(3, _m)] = 10 * 7 * 2  # 140
# Table 4: 4 methods x 2 tasks x {speedup, gain}; Vanilla and LS gains are "-".
for _m in ["llama2-7b", "llama2-13b"]:
    EXPECTED_COUNTS[(4, _m)] = 4 * 2 * 2 - 2 * 2  # 12
# Table 5: 3 methods x 7 columns (6 tasks + overall) x {memory, overhead}; Vanilla overhead is "-".
EXPECTED_COUNTS[(5, "llama2-7b")] = 3 * 7 * 2 - 7  # 35
# Table 6: 8 omega columns (the Vanilla "omega=-" column has setting "") x {eTPL, speed, speedup}.
EXPECTED_COUNTS[(6, "llama2-7b")] = 8 * 3  # 24

EXPECTED_TABLE_TOTALS = {1: 250, 2: 50, 3: 700, 4: 24, 5: 35, 6: 24}

INT_OR_EMPTY = re.compile(r"^(\d+)?$")


def _load(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with path.open(newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh)
        header = list(reader.fieldnames or [])
        rows = [{k: (v if v is not None else "") for k, v in row.items()} for row in reader]
    return header, rows


def _key(row: dict[str, str]) -> tuple[str, ...]:
    return tuple(row[c].strip() for c in KEY_COLUMNS)


def _fmt(row: dict[str, str]) -> str:
    return ",".join(row.get(c, "") for c in COLUMNS)


def _schema_errors(rows: list[dict[str, str]], label: str) -> list[str]:
    errors = []
    for i, row in enumerate(rows, start=2):  # line 1 is the header
        where = f"{label} line {i} ({_fmt(row)})"
        if None in row or any(c not in row for c in COLUMNS):
            errors.append(f"{where}: wrong number of fields")
            continue
        table = row["table"].strip()
        if table not in {"1", "2", "3", "4", "5", "6"}:
            errors.append(f"{where}: table {table!r} not in 1..6")
            continue
        t = int(table)
        if row["model"] not in MODELS:
            errors.append(f"{where}: unknown model {row['model']!r}")
        if row["task"] not in TASKS:
            errors.append(f"{where}: unknown task {row['task']!r}")
        if row["method"] not in METHODS:
            errors.append(f"{where}: unknown method {row['method']!r}")
        if row["metric"] not in METRICS:
            errors.append(f"{where}: unknown metric {row['metric']!r}")
        for col in ("exit_layer", "gamma"):
            if not INT_OR_EMPTY.match(row[col]):
                errors.append(f"{where}: {col} {row[col]!r} is not an integer or empty")
        # exit layer / gamma must agree with the method label family.
        has_e, has_g = bool(row["exit_layer"]), bool(row["gamma"])
        if row["method"] in {"ls", "fs"} and not (has_e and has_g):
            errors.append(f"{where}: {row['method']} needs exit_layer and gamma")
        if row["method"] == "dv" and not (has_e and not has_g):
            errors.append(f"{where}: dv needs exit_layer and no gamma")
        if row["method"] in {"vanilla", "del", "swift"} and (has_e or has_g):
            errors.append(f"{where}: {row['method']} has no exit_layer/gamma in the paper")
        # settings
        setting = row["setting"]
        if t == 2:
            if setting not in {"pass@1", "pass@10"}:
                errors.append(f"{where}: Table 2 setting must be pass@1 or pass@10")
        elif t == 6:
            # The Vanilla column is printed as "omega=-" (omega does not apply): empty setting.
            if row["method"] == "vanilla":
                if setting != "":
                    errors.append(f"{where}: Table 6 Vanilla column has an empty setting")
            elif not re.match(r"^omega=\d+(\.\d+)?$", setting):
                errors.append(f"{where}: Table 6 setting must be omega=<value as printed>")
        elif setting != "":
            errors.append(f"{where}: Table {t} has no setting qualifier, got {setting!r}")
        try:
            val = float(row["value"])
        except ValueError:
            errors.append(f"{where}: value {row['value']!r} does not parse as a float")
        else:
            if not math.isfinite(val):
                errors.append(f"{where}: value {row['value']!r} is not finite")
        if "underlined" in row and row["underlined"].strip() not in TRUTHY:
            errors.append(f"{where}: underlined {row['underlined']!r} is not a boolean")
    return errors


def _duplicates(rows: list[dict[str, str]]) -> list[str]:
    counts = Counter(_key(r) for r in rows)
    return [",".join(k) for k, n in counts.items() if n > 1]


@pytest.fixture(scope="module")
def check_rows() -> list[dict[str, str]]:
    header, rows = _load(CHECK_CSV)
    assert header == COLUMNS, f"check file header {header} != {COLUMNS}"
    return rows


@pytest.fixture(scope="module")
def main_data() -> tuple[list[str], list[dict[str, str]]]:
    if not MAIN_CSV.exists():
        pytest.skip(f"main transcription {MAIN_CSV.relative_to(REPO)} does not exist yet")
    return _load(MAIN_CSV)


def test_check_file_is_well_formed(check_rows):
    assert not _schema_errors(check_rows, "check"), "\n".join(_schema_errors(check_rows, "check"))
    assert not _duplicates(check_rows), _duplicates(check_rows)
    per_table = Counter(int(r["table"]) for r in check_rows)
    assert len(check_rows) >= 60
    for t in range(1, 7):
        assert per_table[t] >= 6, f"check file has only {per_table[t]} cells of Table {t}"


def test_main_header(main_data):
    header, _ = main_data
    assert header[: len(COLUMNS)] == COLUMNS, f"main header {header} must start with {COLUMNS}"
    extra = set(header[len(COLUMNS):])
    assert extra <= OPTIONAL_COLUMNS, f"unexpected extra columns in main file: {sorted(extra)}"


def test_main_schema_and_types(main_data):
    _, rows = main_data
    errors = _schema_errors(rows, "main")
    assert not errors, f"{len(errors)} schema errors:\n" + "\n".join(errors[:50])


def test_main_has_no_duplicate_keys(main_data):
    _, rows = main_data
    dups = _duplicates(rows)
    assert not dups, f"{len(dups)} duplicate keys:\n" + "\n".join(dups[:50])


def test_check_cells_match_main(main_data, check_rows):
    _, rows = main_data
    index: dict[tuple[str, ...], list[dict[str, str]]] = {}
    for r in rows:
        index.setdefault(_key(r), []).append(r)
    problems = []
    for c in check_rows:
        hits = index.get(_key(c), [])
        if len(hits) != 1:
            problems.append(f"{_fmt(c)}: {len(hits)} matching rows in main file (want 1)")
        elif hits[0]["value"].strip() != c["value"].strip():
            problems.append(f"{_fmt(c)}: main file has value {hits[0]['value']!r}")
    assert not problems, f"{len(problems)} of {len(check_rows)} checked cells disagree:\n" + "\n".join(problems)


def test_main_row_counts(main_data):
    _, rows = main_data
    per_table = Counter(int(r["table"]) for r in rows if r["table"].strip().isdigit())
    per_model = Counter(
        (int(r["table"]), r["model"]) for r in rows if r["table"].strip().isdigit()
    )
    problems = []
    for t, want in EXPECTED_TABLE_TOTALS.items():
        if per_table[t] != want:
            problems.append(f"Table {t}: {per_table[t]} rows, expected {want}")
    for (t, m), want in EXPECTED_COUNTS.items():
        if per_model[(t, m)] != want:
            problems.append(f"Table {t} {m}: {per_model[(t, m)]} rows, expected {want}")
    for (t, m), n in per_model.items():
        if (t, m) not in EXPECTED_COUNTS:
            problems.append(f"Table {t} {m}: {n} rows, but this model is not in Table {t}")
    assert not problems, "\n".join(problems)
