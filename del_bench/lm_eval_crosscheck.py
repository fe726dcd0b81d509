"""Our task files' scoring against lm-eval's, on the same outputs: GSM8K accuracy and HumanEval pass@1.

    python -m del_bench lm-eval crosscheck RESULTS.json [RESULTS.json …] [--ours RUN_DIR …]

For each task of an lm-eval results file that one of ours scores (gsm8k_local and gsm8k → our gsm8k,
humaneval_sandbox and humaneval → our humaneval), every output lm-eval scored (its logged samples: --log_samples) is
scored again by our task file (del_bench/tasks/): GSM8K's `correct` beside lm-eval's strict-match exact_match and
`correct_flexible` beside its flexible-extract; HumanEval's `passed` (the completion cut at CODE_STOPS, run in our
sandbox) beside pass@1. The table gives both means and the documents on which the two scorers disagree.

--ours RUN_DIR: a run of our own task (`python -m del_bench run task=gsm8k|humaneval …`) on documents of the same
file: its mean there — our prompt, length and stop rule — and how many of its outputs, cut at lm-eval's `until` as
lm-eval cut its own, are lm-eval's outputs.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path

from hydra.utils import instantiate

from del_bench.averages import mean
from del_bench.config import load_choice
from del_bench.lm_eval_backend import document_scores, read_results
from del_bench.metrics.text import cut_at
from del_bench.records import read_jsonl
from del_bench.tasks.base import Sample

GSM8K = ("gsm8k", (("exact_match,strict-match", "correct"), ("exact_match,flexible-extract", "correct_flexible")))
# lm-eval task → (our task, ((lm-eval's "metric,filter", our metric), …))
PAIRS = {"gsm8k": GSM8K, "gsm8k_local": GSM8K,
         "humaneval_sandbox": ("humaneval", (("pass@1,none", "passed"),)),
         "humaneval": ("humaneval", (("pass@1,create_test", "passed"),))}


@dataclass
class Check:
    task: str
    model: str
    method: str
    metric: str  # lm-eval's "metric,filter" = our metric
    docs: int
    lm_eval: float
    ours: float
    disagree: list[str]  # doc ids
    own_run: str = ""  # --ours: our task's run on these documents (mean, n, outputs equal to lm-eval's)


def sample_of(task: str, doc: dict) -> Sample:
    """The Sample our task file scores an output of this lm-eval document against."""
    if task == "gsm8k":
        return Sample(id="", prompt="", reference=doc["answer"])
    return Sample(id=doc["task_id"], prompt=doc["prompt"], reference=doc["canonical_solution"],
                  meta={"entry_point": doc["entry_point"], "test": doc["test"]})


def our_id(task: str, doc_id: str, doc: dict) -> str:
    """The sample id our task gives this document (GSM8K: its position in the test split; HumanEval: its task id)."""
    return doc_id if task == "gsm8k" else doc["task_id"]


def check(path: str | Path, ours: list[str] = ()) -> list[Check]:
    """Both scorers on every output of the results file at `path` (tasks we have no scorer for are left out)."""
    return check_results(read_results(path), ours)


def check_results(results: dict, ours: list[str] = ()) -> list[Check]:
    """check on lm-eval's results with their logged samples (results["samples"]: saved, or simple_evaluate's)."""
    info = (results.get("config") or {}).get("del_bench") or {}
    model, method = info.get("model") or results.get("config", {}).get("model", "?"), info.get("method_tag", "")
    checks = []
    for task, samples in results["samples"].items():
        if task not in PAIRS or not samples:
            continue
        ours_task, metrics = PAIRS[task]
        docs = {str(s["doc_id"]): s for s in samples}  # one line per document and filter: the same output in each
        ids = sorted(docs, key=int)
        outputs = [docs[i]["resps"][0][0] for i in ids]
        scorer = instantiate(load_choice("task", ours_task))
        mine = scorer.score_batch([(sample_of(ours_task, docs[i]["doc"]), text) for i, text in zip(ids, outputs)])
        theirs = document_scores(samples)
        until = results.get("configs", {}).get(task, {}).get("generation_kwargs", {}).get("until", [])
        own = _own_runs(ours, ours_task, {our_id(ours_task, i, docs[i]["doc"]): out for i, out in zip(ids, outputs)},
                        until)
        for lm_key, our_key in metrics:
            disagree = [i for i, m in zip(ids, mine) if float(m[our_key]) != theirs[i][lm_key]]
            checks.append(Check(task, model, method, f"{lm_key} = {our_key}", len(ids),
                                mean((theirs[i][lm_key] for i in ids), math.nan),
                                mean((m[our_key] for m in mine), math.nan), disagree, own.get(our_key, "")))
    return checks


def _own_runs(run_dirs: list[str], task: str, outputs: dict[str, str], until: list[str]) -> dict[str, str]:
    """{our metric: "mean over n (k of n outputs = lm-eval's)"} from the first of our runs of `task` that shares
    documents with these outputs."""
    for run_dir in run_dirs:
        summary = json.loads((Path(run_dir) / "summary.json").read_text())
        if summary["task"] != task:
            continue
        records = [r for r in read_jsonl(Path(run_dir) / "samples.jsonl") if r["sample_id"] in outputs]
        if not records:
            continue
        equal = sum(cut_at(r["output_text"], until) == outputs[r["sample_id"]] for r in records)
        metrics = {k for r in records for k in (r.get("scores") or {})}
        return {k: f"{mean((r['scores'][k] for r in records), math.nan):.3f} over {len(records)} ({equal} of "
                   f"{len(records)} outputs = lm-eval's)" for k in metrics}
    return {}


def table(checks: list[Check]) -> str:
    lines = ["| lm-eval task | model | method | metric (lm-eval = ours) | docs | lm-eval | ours, same outputs | "
             "documents that disagree | our task's own run |", "|---|---|---|---|---|---|---|---|---|"]
    for c in checks:
        lines.append(f"| {c.task} | {c.model} | {c.method} | {c.metric} | {c.docs} | {c.lm_eval:.3f} | {c.ours:.3f} | "
                     f"{', '.join(c.disagree) or 'none'} | {c.own_run or '-'} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m del_bench lm-eval crosscheck", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", help="lm-eval results files (results_<date>.json, samples logged beside)")
    ap.add_argument("--ours", nargs="*", default=[], help="run directories of our own gsm8k / humaneval task")
    args = ap.parse_args(argv)
    print(table([c for path in args.results for c in check(path, args.ours)]))
    return 0
