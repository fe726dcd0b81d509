"""Spec-Bench (Xia et al., 2024) interchange: its categories, our records in its answer layout, and its speed metric.

    CATEGORIES, GROUPS        the 13 question categories and the 6 groups its tables print (+ "overall")
    answer_lines(run_dir)     one Spec-Bench answer line per question of a run (dicts)
    export(run_dir, out)      those lines as JSONL: `python -m del_bench export specbench RUN_DIR OUT.jsonl`
    speed(jsonl, base_jsonl)  Spec-Bench's evaluation/speed.py, reconstructed (see below)

The answer layout is the one Spec-Bench's evaluation/eval.py writes, one line per question:

    {"question_id": 81, "category": "writing", "answer_id": "…", "model_id": "…", "tstamp": 1.7e9,
     "choices": [{"index": 0, "turns": [text, …], "decoding_steps": [steps, …], "new_tokens": [n, …],
                  "wall_time": [seconds, …], "accept_lengths": [k, k, …]}]}

with per-turn lists (MT-bench questions have two turns) and `accept_lengths` concatenated over the turns. How our
records map onto it:

  * a decoding step is one of our rounds, the prefill included (round 0, which emits the first token): so
    decoding_steps = the turn's rounds, accept_lengths = each round's `emitted` (accepted drafts + the bonus
    token), and sum(accept_lengths) = new_tokens. Vanilla writes 1 per token, as Spec-Bench's baseline does.
    (Spec-Bench's own speculative methods do not count the prefill as a step; with hundreds of tokens per turn
    the extra step of length 1 moves the mean accepted length by well under 1%.)
  * new_tokens = the turn's generated tokens; wall_time = the turn's wall seconds (prefill + rounds, as timed by
    the engine; tokenisation excluded); turns = the turn's decoded text, stripped (as Spec-Bench stores it).
  * choices[k] = repeat k of the question (greedy runs have one); answer_id is derived from the run and the
    question (stable across exports); tstamp = when samples.jsonl was last written (no per-question timestamp
    is recorded).

`speed` reconstructs Spec-Bench's evaluation/speed.py from its description (its code is not on this machine):
for each question line, choices[0]'s new_tokens and wall_time are summed over turns; tokens/s per question;
speed = the mean over questions; speedup = speed ÷ the baseline's speed; mean accepted tokens = the mean of all
accept_lengths of all questions (the method's file). The selection is a category, "mt_bench" (its 8 categories) or
"overall" (all). speed.py recounts the baseline's tokens from its text (`len(tokenizer(turn).input_ids) - 1` per
turn: LLaMA's tokenizer adds a BOS); that is `speed(…, tokenizer=T)`. Without a tokenizer the baseline's
new_tokens are used, which is what our report computes from the records (the two differ only where re-encoding
the decoded text does not give back the generated token count).
"""

from __future__ import annotations

import hashlib
import json
import statistics
from pathlib import Path

from del_bench.records import read_jsonl

MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
CATEGORIES = MT_BENCH + ("translation", "summarization", "qa", "math_reasoning", "rag")
# the columns of Spec-Bench's tables: MT-bench pooled, then one per other category
GROUPS: dict[str, tuple[str, ...]] = {"mt_bench": MT_BENCH, "translation": ("translation",),
                                      "summarization": ("summarization",), "qa": ("qa",),
                                      "math_reasoning": ("math_reasoning",), "rag": ("rag",)}
GROUP_LABELS = {"mt_bench": "MT-bench", "translation": "Translation", "summarization": "Summarization",
                "qa": "QA", "math_reasoning": "Math", "rag": "RAG", "overall": "Overall"}


def in_group(category: str | None, group: str) -> bool:
    """Spec-Bench's task selection: "overall" = every question, "mt_bench" = its 8 categories, else the category."""
    if group == "overall":
        return True
    return category in GROUPS.get(group, (group,))


def record_turns(sample: dict, rounds: list[dict]) -> list[dict]:
    """The turns of one samples.jsonl record, each with its rounds: a multi-turn record's `turns` (rounds matched
    by their `turn` field), or the whole record as one turn (single-prompt tasks)."""
    if sample.get("turns"):
        turns = [dict(t) for t in sample["turns"]]
        for i, turn in enumerate(turns):
            turn["round_rows"] = [r for r in rounds if r.get("turn", 0) == i]
        return turns
    return [{"output_text": sample["output_text"], "new_tokens": sample["generated_tokens"],
             "wall_s": sample["wall_s"], "rounds": sample["rounds"], "round_rows": rounds}]


def _question_id(sample_id: str):
    return int(sample_id) if str(sample_id).isdigit() else sample_id


def answer_lines(run_dir: str | Path, model_id: str | None = None) -> list[dict]:
    """Spec-Bench answer lines for every question of a finished run, in question order."""
    from del_bench.records import run_key_of

    run_dir = Path(run_dir)
    if not (run_dir / "summary.json").is_file():
        raise FileNotFoundError(f"{run_dir}: no summary.json (not a finished run directory)")
    summary = json.loads((run_dir / "summary.json").read_text())
    samples = read_jsonl(run_dir / "samples.jsonl")
    key = run_key_of(summary, samples)
    model_id = model_id or f"{key.model}-{key.method_tag}"
    rounds: dict[tuple, list[dict]] = {}
    for r in read_jsonl(run_dir / "rounds.jsonl"):
        rounds.setdefault((str(r["sample_id"]), r.get("repeat", 0)), []).append(r)
    tstamp = (run_dir / "samples.jsonl").stat().st_mtime
    by_question: dict[str, list[dict]] = {}
    for s in samples:
        by_question.setdefault(str(s["sample_id"]), []).append(s)
    lines = []
    for sid in sorted(by_question, key=lambda i: (0, int(i), "") if i.isdigit() else (1, 0, i)):
        choices = []
        for s in sorted(by_question[sid], key=lambda s: s.get("repeat", 0)):
            turns = record_turns(s, rounds.get((sid, s.get("repeat", 0)), []))
            accept = []
            for i, t in enumerate(turns):
                emitted = [int(r["emitted"]) for r in t["round_rows"]]
                if sum(emitted) != t["new_tokens"] or len(emitted) != t["rounds"]:
                    raise ValueError(f"{run_dir}: sample {sid} turn {i}: rounds.jsonl holds {len(emitted)} rounds "
                                     f"emitting {sum(emitted)} tokens, samples.jsonl says {t['rounds']} rounds and "
                                     f"{t['new_tokens']} tokens")
                accept += emitted
            choices.append({"index": s.get("repeat", 0),
                            "turns": [t["output_text"].strip() for t in turns],
                            "decoding_steps": [t["rounds"] for t in turns],
                            "new_tokens": [t["new_tokens"] for t in turns],
                            "wall_time": [t["wall_s"] for t in turns],
                            "accept_lengths": accept})
        category = by_question[sid][0].get("category") or key.task
        answer_id = hashlib.sha1(f"{model_id}|{key.prompts}|{key.machine}|{sid}".encode()).hexdigest()[:22]
        lines.append({"question_id": _question_id(sid), "category": category, "answer_id": answer_id,
                      "model_id": model_id, "choices": choices, "tstamp": tstamp})
    return lines


def export(run_dir: str | Path, out_path: str | Path, model_id: str | None = None) -> int:
    """Write the run's answer lines to out_path (JSONL); returns the number of questions."""
    lines = answer_lines(run_dir, model_id)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text("".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines))
    return len(lines)


def _select(path: str | Path, task: str) -> list[dict]:
    return [d for d in read_jsonl(Path(path)) if in_group(d.get("category"), task)]


def speed(jsonl_file: str | Path, jsonl_file_base: str | Path, task: str = "overall", tokenizer=None) -> dict:
    """Spec-Bench's speed.py for one task selection: tokens/s of the method and of the baseline (means over
    questions), their ratio, and the method's mean accepted tokens (mean of all its accept_lengths).

    tokenizer: None → the baseline's new_tokens; a tokenizer → its tokens recounted from its text as speed.py
    does (`len(tokenizer(turn).input_ids) - 1` per turn)."""
    speeds, accept = [], []
    for d in _select(jsonl_file, task):
        choice = d["choices"][0]
        speeds.append(sum(choice["new_tokens"]) / sum(choice["wall_time"]))
        accept.extend(choice["accept_lengths"])
    speeds0 = []
    for d in _select(jsonl_file_base, task):
        choice = d["choices"][0]
        if tokenizer is None:
            tokens = sum(choice["new_tokens"])
        else:
            tokens = sum(len(tokenizer(text)["input_ids"]) - 1 for text in choice["turns"])
        speeds0.append(tokens / sum(choice["wall_time"]))
    if not speeds or not speeds0:
        return {"task": task, "questions": len(speeds), "tokens_per_s": None, "baseline_tokens_per_s": None,
                "speedup": None, "mean_accepted_tokens": None}
    tps, base = statistics.fmean(speeds), statistics.fmean(speeds0)
    return {"task": task, "questions": len(speeds), "tokens_per_s": tps, "baseline_tokens_per_s": base,
            "speedup": tps / base, "mean_accepted_tokens": statistics.fmean(accept) if accept else None}


def speed_table(jsonl_file, jsonl_file_base, tokenizer=None) -> list[dict]:
    """speed() for each of Spec-Bench's printed selections: the 6 groups, then overall."""
    return [speed(jsonl_file, jsonl_file_base, task, tokenizer) for task in [*GROUPS, "overall"]]
