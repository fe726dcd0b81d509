"""Spec-Bench: the task (chat rendering, turn 2 after the model's own turn 1, category selection, a bad question file
named by file and line), the runner's multi-turn records, the export in Spec-Bench's answer layout field by field,
and the report's Spec-Bench table agreeing with Spec-Bench's speed logic on the exported files."""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import pytest

from del_bench import __main__ as cli
from del_bench import runner, specbench
from del_bench.errors import TaskError
from del_bench.models import loading
from del_bench.models.loading import ByteTokenizer
from del_bench.report.collect import load_runs
from del_bench.report.specbench import run_metrics, specbench_table, write_specbench
from del_bench.tasks.base import Sample
from del_bench.tasks.specbench import SpecBench, plain_prompt

QUESTIONS = [
    {"question_id": 81, "category": "writing", "turns": ["Write a haiku.", "Now make it rhyme."]},
    {"question_id": 101, "category": "reasoning", "turns": ["Is 7 prime?", "And 9?"]},
    {"question_id": 161, "category": "translation", "turns": ["Translate: Guten Tag"], "reference": ["Good day"]},
    {"question_id": 162, "category": "translation", "turns": ["Translate: Danke"]},
    {"question_id": 401, "category": "qa", "turns": ["Who wrote Hamlet?"]},
    {"question_id": 402, "category": "qa", "turns": ["What is the capital of France?"]},
    {"question_id": 403, "category": "qa", "turns": ["How many legs has a spider?"]},
]


def write_questions(path: Path, questions=QUESTIONS) -> Path:
    path.write_text("".join(json.dumps(q) + "\n" for q in questions))
    return path


@pytest.fixture
def questions(tmp_path) -> Path:
    return write_questions(tmp_path / "question.jsonl")


# ---- the task ------------------------------------------------------------------------------------------------

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def chat_tokenizer():
    """A real transformers tokenizer with a chat template (word level, offline)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({"[UNK]": 0, "<s>": 1}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", bos_token="<s>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def test_two_turn_question_renders_with_the_chat_template_second_turn_after_the_first_answer():
    task = SpecBench(data_files=None)
    task.bind_tokenizer(chat_tokenizer())
    sample = Sample(id="81", prompt="Write a haiku.", turns=["Write a haiku.", "Now make it rhyme."])
    first = task.render(sample, [])
    assert first == "<|user|>Write a haiku.<|end|><|assistant|>"
    second = task.render(sample, [("Write a haiku.", "Leaves fall.")])
    assert second == ("<|user|>Write a haiku.<|end|><|assistant|>Leaves fall.<|end|>"
                      "<|user|>Now make it rhyme.<|end|><|assistant|>")
    assert task.prompt_format.startswith("chat_template:")  # + a digest of the template
    task = SpecBench(data_files=None, system_prompt="Be brief.")
    task.bind_tokenizer(chat_tokenizer())
    assert task.render(sample, []).startswith("<|system|>Be brief.<|end|><|user|>")


def test_without_a_chat_template_turns_are_rendered_user_assistant():
    task = SpecBench(data_files=None)
    task.bind_tokenizer(ByteTokenizer())  # tiny-random's: no chat template
    sample = Sample(id="81", prompt="a", turns=["Write a haiku.", "Now make it rhyme."])
    assert task.prompt_format == "plain"
    assert task.render(sample, [("Write a haiku.", "Leaves fall.")]) == (
        "User: Write a haiku.\nAssistant: Leaves fall.\nUser: Now make it rhyme.\nAssistant:")
    forced = SpecBench(data_files=None, chat="plain")
    forced.bind_tokenizer(chat_tokenizer())
    assert forced.prompt_format == "plain"
    with pytest.raises(TaskError, match="no chat template"):
        SpecBench(data_files=None, chat="template").bind_tokenizer(ByteTokenizer())


def test_category_selection(questions):
    every = SpecBench(data_files=str(questions)).select(None, 42)
    assert [s.id for s in every] == ["81", "101", "161", "162", "401", "402", "403"]
    assert every[0].turns == QUESTIONS[0]["turns"] and every[0].category == "writing"
    picked = SpecBench(data_files=str(questions), categories=["qa", "mt_bench"]).select(None, 42)
    assert [s.category for s in picked] == ["writing", "reasoning", "qa", "qa", "qa"]
    per = SpecBench(data_files=str(questions), per_category=2).select(None, 42)
    counts = {c: sum(s.category == c for s in per) for c in ("writing", "reasoning", "translation", "qa")}
    assert counts == {"writing": 1, "reasoning": 1, "translation": 2, "qa": 2}
    assert [s.id for s in per] == sorted((s.id for s in per), key=int)  # source order kept
    assert SpecBench(data_files=str(questions), per_category=2).select(None, 42) == per  # seeded
    with pytest.raises(TaskError, match="unknown category 'mtbench'.*mt_bench"):
        SpecBench(data_files=str(questions), categories=["mtbench"])


@pytest.mark.parametrize("bad, message", [
    ({"question_id": 90, "category": "writing"}, "missing turns"),
    ({"question_id": 90, "category": "writing", "turns": []}, "missing turns"),
    ({"question_id": 90, "category": "poetry", "turns": ["Hi"]}, "unknown category 'poetry'"),
    ({"category": "qa", "turns": ["Hi"]}, "no question_id"),
    ({"question_id": 81, "category": "qa", "turns": ["Hi"]}, "question_id 81 repeats line 1"),
])
def test_a_bad_question_file_is_rejected_naming_file_and_line(tmp_path, bad, message):
    path = write_questions(tmp_path / "bad.jsonl", QUESTIONS[:2] + [bad])
    with pytest.raises(TaskError, match=re.escape(f"{path}:3") + ".*" + re.escape(message)):
        SpecBench(data_files=str(path)).load()


def test_a_bad_question_file_fails_before_any_weights_load(run_cfg, tmp_path, monkeypatch):
    path = write_questions(tmp_path / "bad.jsonl", [{"question_id": 1, "category": "qa"}])

    def refuse(_):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(loading, "load", refuse)
    with pytest.raises(TaskError, match=re.escape(f"{path}:1")):
        runner.run(run_cfg("task=specbench", f"task.data_files={path}"))


# ---- multi-turn records ----------------------------------------------------------------------------------------

def specbench_run(run_cfg, questions, out, method="vanilla", *extra):
    cfg = run_cfg("task=specbench", f"task.data_files={questions}", f"method={method}", "limit=null",
                  "max_new_tokens=6", f"out_dir={out}", "experiment_name=specbench_local", *extra)
    runner.run(cfg)
    return Path(out)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("method", ["ls", "fs", "dv", "del", "del_cpu"])
def test_every_method_decodes_turn_by_turn_losslessly(run_cfg, tmp_path, questions, method):
    cats = "task.categories=[writing,qa]"
    vanilla = read_jsonl(specbench_run(run_cfg, questions, tmp_path / "v", "vanilla", cats) / "samples.jsonl")
    other = specbench_run(run_cfg, questions, tmp_path / method, method, cats)
    records = read_jsonl(other / "samples.jsonl")
    assert [r["output_ids"] for r in records] == [r["output_ids"] for r in vanilla]  # greedy: Vanilla's tokens
    assert [len(r["turns"]) for r in records] == [2, 1, 1, 1]


def test_multi_turn_record_keeps_per_turn_numbers_and_sums_them(run_cfg, tmp_path, questions):
    out = specbench_run(run_cfg, questions, tmp_path / "ls", "ls", "method.exit_layer=1", "method.gamma=2",
                        "task.categories=[writing,translation]")
    records, rounds = read_jsonl(out / "samples.jsonl"), read_jsonl(out / "rounds.jsonl")
    first = records[0]
    assert (first["sample_id"], first["category"], first["prompt_format"]) == ("81", "writing", "plain")
    one, two = first["turns"]
    # turn 2 is asked after the model's own first answer
    assert two["prompt"] == plain_prompt([("Write a haiku.", one["output_text"].strip())], "Now make it rhyme.")
    assert one["prompt"] == first["prompt"] == "User: Write a haiku.\nAssistant:"
    assert first["output_ids"] == one["output_ids"] + two["output_ids"]
    for key, total in (("new_tokens", "generated_tokens"), ("wall_s", "wall_s"), ("rounds", "rounds"),
                       ("loaded_layers", "loaded_layers"), ("drafted", "drafted"), ("accepted", "accepted")):
        assert math.isclose(one[key] + two[key], first[total]), key
    assert math.isclose(first["tokens_per_s"], first["generated_tokens"] / first["wall_s"])
    mine = [r for r in rounds if r["sample_id"] == "81"]
    assert [r["turn"] for r in mine] == [0] * one["rounds"] + [1] * two["rounds"]
    assert [r["round"] for r in mine if r["turn"] == 1][0] == 0  # rounds restart per turn (0 = its prefill)
    for turn in (one, two):
        assert sum(r["emitted"] for r in mine if r["turn"] == turn["turn"]) == turn["new_tokens"]
    assert len(records[1]["turns"]) == 1 and records[1]["category"] == "translation"


# ---- export ----------------------------------------------------------------------------------------------------

KNOWN_KEY = {"model": "m", "weights": "", "task": "specbench", "task_version": "1", "method": "ls",
             "method_tag": "ls-E1-g2", "hyperparameters": {"exit_layer": 1, "gamma": 2}, "decoding": "greedy",
             "max_new_tokens": 8, "prompts": "abc", "machine": "cpu/x (1 threads)", "experiments": ["specbench"]}


def known_run(root: Path) -> Path:
    """A hand-written run: question 81 with two turns (3 + 2 rounds), question 161 with one."""
    root.mkdir(parents=True)
    (root / "summary.json").write_text(json.dumps({"run_key": KNOWN_KEY}))
    turns = [{"turn": 0, "user": "Write a haiku.", "prompt": "User: Write a haiku.\nAssistant:", "prompt_ids": [1],
              "output_ids": [5, 6, 7, 8, 9], "output_text": " Leaves fall. ", "new_tokens": 5, "wall_s": 0.5,
              "rounds": 3, "loaded_layers": 9, "head_calls": 9, "drafted": 4, "accepted": 2},
             {"turn": 1, "user": "Now make it rhyme.", "prompt": "…", "prompt_ids": [1], "output_ids": [10, 11, 12],
              "output_text": "Leaves fall, all.\n", "new_tokens": 3, "wall_s": 0.25, "rounds": 2,
              "loaded_layers": 6, "head_calls": 6, "drafted": 2, "accepted": 1}]
    samples = [{"sample_id": "81", "repeat": 0, "category": "writing", "generated_tokens": 8, "wall_s": 0.75,
                "rounds": 5, "output_text": "x", "turns": turns},
               {"sample_id": "161", "repeat": 0, "category": "translation", "generated_tokens": 2, "wall_s": 0.1,
                "rounds": 2, "output_text": "Good day", "turns": [
                    {"turn": 0, "output_text": "Good day", "new_tokens": 2, "wall_s": 0.1, "rounds": 2}]}]
    rounds = [{"sample_id": "81", "repeat": 0, "turn": 0, "round": 0, "emitted": 1},
              {"sample_id": "81", "repeat": 0, "turn": 0, "round": 1, "emitted": 3},
              {"sample_id": "81", "repeat": 0, "turn": 0, "round": 2, "emitted": 1},
              {"sample_id": "161", "repeat": 0, "turn": 0, "round": 0, "emitted": 1},
              {"sample_id": "161", "repeat": 0, "turn": 0, "round": 1, "emitted": 1},
              {"sample_id": "81", "repeat": 0, "turn": 1, "round": 0, "emitted": 1},
              {"sample_id": "81", "repeat": 0, "turn": 1, "round": 1, "emitted": 2}]
    (root / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    (root / "rounds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rounds))
    return root


def test_export_of_a_known_multi_turn_record_field_by_field(tmp_path, monkeypatch):
    run = known_run(tmp_path / "run")
    out = tmp_path / "answers" / "m-ls.jsonl"
    monkeypatch.setattr(sys, "argv", ["del_bench", "export", "specbench", str(run), str(out)])
    assert cli.main() == 0
    first, second = read_jsonl(out)
    assert list(first) == ["question_id", "category", "answer_id", "model_id", "choices", "tstamp"]
    assert (first["question_id"], first["category"], first["model_id"]) == (81, "writing", "m-ls-E1-g2")
    assert isinstance(first["answer_id"], str) and len(first["answer_id"]) == 22
    assert isinstance(first["tstamp"], float)
    assert first["choices"] == [{"index": 0, "turns": ["Leaves fall.", "Leaves fall, all."],
                                 "decoding_steps": [3, 2], "new_tokens": [5, 3], "wall_time": [0.5, 0.25],
                                 "accept_lengths": [1, 3, 1, 1, 2]}]  # per round: accepted drafts + bonus
    assert (second["question_id"], second["category"]) == (161, "translation")
    assert second["choices"][0]["accept_lengths"] == [1, 1] and second["choices"][0]["turns"] == ["Good day"]
    assert specbench.answer_lines(run, model_id="mine")[0]["model_id"] == "mine"
    # records whose rounds do not add up are refused, not exported
    (run / "rounds.jsonl").write_text("")
    with pytest.raises(ValueError, match="sample 81 turn 0"):
        specbench.answer_lines(run)


def test_speed_logic_on_answer_files(tmp_path):
    def line(qid, category, tokens, seconds, accept):
        return {"question_id": qid, "category": category, "choices": [
            {"turns": ["a b c"] * len(tokens), "new_tokens": tokens, "wall_time": seconds, "accept_lengths": accept}]}

    method, base = tmp_path / "m.jsonl", tmp_path / "b.jsonl"
    method.write_text("\n".join(json.dumps(x) for x in [line(1, "writing", [4, 4], [1, 1], [2, 2, 2, 2]),
                                                         line(2, "qa", [6], [1], [3, 3])]) + "\n")
    base.write_text("\n".join(json.dumps(x) for x in [line(1, "writing", [4, 4], [2, 2], [1] * 8),
                                                       line(2, "qa", [6], [3], [1] * 6)]) + "\n")
    overall = specbench.speed(method, base)
    assert math.isclose(overall["tokens_per_s"], (4 + 6) / 2) and math.isclose(overall["baseline_tokens_per_s"], 2)
    assert math.isclose(overall["speedup"], 2.5) and math.isclose(overall["mean_accepted_tokens"], 14 / 6)
    mt = specbench.speed(method, base, "mt_bench")
    assert (mt["questions"], mt["speedup"]) == (1, 2.0)
    # speed.py recounts the baseline's tokens from its text: len(tokenizer(turn).input_ids) - 1 per turn
    recount = specbench.speed(method, base, "qa", tokenizer=ByteTokenizer())
    assert math.isclose(recount["baseline_tokens_per_s"], (1 + 5 - 1) / 3)


# ---- report ----------------------------------------------------------------------------------------------------

def test_report_table_equals_specbench_speed_on_the_exported_files(run_cfg, tmp_path, questions):
    runs = tmp_path / "runs"
    specbench_run(run_cfg, questions, runs / "vanilla", "vanilla")
    specbench_run(run_cfg, questions, runs / "ls", "ls", "method.exit_layer=1", "method.gamma=2")
    specbench.export(runs / "vanilla", tmp_path / "vanilla.jsonl")
    specbench.export(runs / "ls", tmp_path / "ls.jsonl")
    df = load_runs([runs])
    metrics = run_metrics(df).set_index("method")
    for group in [*specbench.GROUPS, "overall"]:
        spec = specbench.speed(tmp_path / "ls.jsonl", tmp_path / "vanilla.jsonl", group)
        if group in ("summarization", "math_reasoning", "rag"):  # no such question in this file
            assert spec["speedup"] is None and math.isnan(metrics.loc["ls", f"{group}:speedup"])
            continue
        assert math.isclose(metrics.loc["ls", f"{group}:speedup"], spec["speedup"], rel_tol=1e-12), group
        assert math.isclose(metrics.loc["ls", f"{group}:mat"], spec["mean_accepted_tokens"], rel_tol=1e-12), group
        base = specbench.speed(tmp_path / "vanilla.jsonl", tmp_path / "vanilla.jsonl", group)
        assert base["mean_accepted_tokens"] == 1.0  # Vanilla: 1 per token
    table = specbench_table(df)
    ls_row = next(r for r in table.rows if r.label.startswith("LS"))
    overall = specbench.speed(tmp_path / "ls.jsonl", tmp_path / "vanilla.jsonl")
    assert ls_row.cells["overall:speedup"].render() == f"{overall['speedup']:.2f}"
    assert ls_row.cells["rag:speedup"].render() == "–"
    written = write_specbench(df, tmp_path / "tables")
    assert [p.name for p in written] == ["specbench.md", "specbench.tex"]
    text = written[0].read_text()
    assert "MT-bench Speedup" in text and "Overall MAT" in text and "prompt format plain" in text


def test_no_specbench_runs_no_table_file(df, tmp_path):  # the golden records of the paper tables
    assert specbench_table(df) is None
    assert write_specbench(df, tmp_path) == [] and not list(tmp_path.iterdir())


# ---- configs and the offline question file --------------------------------------------------------------------

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench" / "question.jsonl"


def test_config_reads_the_question_file_through_data_local(monkeypatch, tmp_path):
    from tests.test_experiments import compose_cfg

    monkeypatch.setenv("DEL_BENCH_DATA", str(tmp_path / "data"))
    assert compose_cfg("run", "task=specbench").task.data_files is None  # not on the hub
    assert compose_cfg("run", "task=specbench", "data=local").task.data_files == (
        f"{tmp_path}/data/spec_bench/question.jsonl")
    cfg = compose_cfg("run", "experiment=specbench", "scale=local", "method=ls")
    assert (cfg.task.per_category, cfg.max_new_tokens, cfg.method.tag) == (2, 64, "ls-E27-g2")  # the model's (E, γ)
    assert cfg.out_dir.startswith("results/runs/local/smollm2-135m/specbench/")
    cfg = compose_cfg("run", "experiment=specbench")
    assert (cfg.limit, cfg.max_new_tokens) == (None, 1024)
    assert cfg.task.data_files == f"{tmp_path}/data/spec_bench/question.jsonl"
    with pytest.raises(TaskError, match="data=local"):
        SpecBench(data_files=None).load()


@pytest.mark.skipif(not SHARED.is_file(), reason=f"{SHARED} not present")
def test_the_offline_question_file_holds_spec_bench():
    samples = SpecBench(data_files=str(SHARED)).load()
    assert len(samples) == 480 and len({s.id for s in samples}) == 480
    counts = {c: sum(s.category == c for s in samples) for c in specbench.CATEGORIES}
    assert counts == {**{c: 10 for c in specbench.MT_BENCH},
                      **{c: 80 for c in ("translation", "summarization", "qa", "math_reasoning", "rag")}}
    assert all(len(s.turns) == (2 if s.category in specbench.MT_BENCH else 1) for s in samples)
    assert len(SpecBench(data_files=str(SHARED), per_category=2).select(None, 42)) == 26
