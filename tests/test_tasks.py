"""The seven paper tasks on a few local records: exact prompt text, shot and sample selection, scoring of
hand-made outputs, clear errors; then the same tasks on the offline copies in ../shared/data (skipped when
that directory is absent)."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
from hydra.utils import get_class, instantiate
from omegaconf import OmegaConf

from del_bench.tasks.aqua_rat import AquaRat
from del_bench.tasks.base import Task, TaskError
from del_bench.tasks.cnndm_lm import CnnDmLM
from del_bench.tasks.cnndm_sum import CnnDmSum
from del_bench.tasks.gsm8k import GSM8K
from del_bench.tasks.humaneval import HumanEval
from del_bench.tasks.wmt14_de_en import Wmt14DeEn
from del_bench.tasks.xsum import XSum

REPO = Path(__file__).resolve().parents[1]
LOCAL = REPO / "tests" / "data" / "tasks"
SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
CONFIGS = REPO / "configs" / "task"
PAPER_TASKS = ["cnndm_lm", "cnndm_sum", "xsum", "humaneval", "humaneval_pass10", "gsm8k", "aqua_rat",
               "wmt14_de_en"]
RUNNER_KEYS = {"_target_", "samples_per_prompt", "generation"}  # read by the runner, not the task

needs_shared = pytest.mark.skipif(not SHARED.is_dir(), reason=f"offline data directory {SHARED} not present")


@pytest.fixture
def hub_offline(monkeypatch):
    """Make hub access fail at once (no network retries), as on a machine without the hub."""
    import datasets

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)


# ---------------------------------------------------------------- exact prompts (golden strings)


def test_cnndm_lm_prompt_and_reference():
    samples = CnnDmLM(data_files=str(LOCAL / "cnndm.jsonl"), prefix_words=3).load()
    assert [s.id for s in samples] == ["c1", "c2", "c3"]
    assert samples[0].prompt == "one two three"
    assert samples[0].reference == "four five six seven"


def test_cnndm_sum_one_shot_prompt():
    # The eval file doubles as the shot pool (the offline CNN/DM case): seed 42 picks c3, which leaves the samples.
    task = CnnDmSum(data_files=str(LOCAL / "cnndm.jsonl"), shots_files=str(LOCAL / "cnndm.jsonl"))
    samples = task.load()
    assert [s.id for s in samples] == ["c1", "c2"]
    assert samples[0].prompt == ("Article: red green blue\nSummary: Colours .Three of them .\n"
                                 "\n"
                                 "Article: one two three four five six seven\nSummary:")
    assert samples[0].reference == "Numbers ."


def test_xsum_zero_shot_prompt():
    samples = XSum(data_files=str(LOCAL / "xsum.jsonl")).load()
    assert [s.id for s in samples] == ["101", "102"]
    assert samples[0].prompt == "Article: The council met on Monday.\nIt approved the park.\nSummary:"
    assert samples[0].reference == "A park was approved."


def test_gsm8k_few_shot_prompt():
    task = GSM8K(data_files=str(LOCAL / "gsm8k_test.jsonl"), shots_files=str(LOCAL / "gsm8k_train.jsonl"),
                 n_shot=2, shot_seed=1)
    samples = task.load()
    assert [s.id for s in samples] == ["0", "1"]
    assert samples[1].prompt == ("Question: Q5?\nAnswer: A5\n#### 5\n"
                                 "Question: Q1?\nAnswer: A1\n#### 1\n"
                                 "\n"
                                 "Question: A box holds 1,200 pins. How many pins are in 2 boxes?\nAnswer:")
    assert samples[1].meta == {"answer_number": "2400"}


def test_aqua_prompt_with_sirius_cleanup():
    task = AquaRat(data_files=str(LOCAL / "aqua_test.jsonl"), fewshot_file=str(LOCAL / "aqua_shots.txt"))
    samples = task.load()
    assert samples[0].prompt == (
        "Q: What is 1+1?\n"  # the literal "\n" sequence of the file is removed, as Sirius does
        "Options: (a) 1 (b) 2 (c) 3 (d) 4 (e) 5\nA: 1+1 = 2. So the answer is (b).\n\n"
        "Q: What is 3*3?\nOptions: (a) 6 (b) 8 (c) 9 (d) 12 (e) 27\nA: 3*3 = 9. So the answer is (c).\n\n"
        "Q: What is 2+3?\nOptions: (a) 4 (b) 5 (c) 6 (d) 7 (e) 8\nA:")
    assert samples[1].prompt.endswith("Q: What is 10/2?\nOptions: (a) 2 (b) 3 (c) 4 (d) 5 (e) None of these\nA:")
    assert samples[0].meta == {"correct": "b"}


def test_wmt14_prompt():
    samples = Wmt14DeEn(data_files=str(LOCAL / "wmt14.jsonl")).load()
    assert samples[1].prompt == ("You are a professional translator. Translate the following German sentence "
                                 "into English.\nGerman: Das Haus ist klein.\nEnglish:")
    assert samples[1].reference == "The house is small."


def test_humaneval_embedded_default():
    samples = HumanEval().load()
    assert len(samples) == 164
    assert samples[0].id == "HumanEval/0"
    assert samples[0].prompt.startswith("from typing import List\n\n\ndef has_close_elements(")
    assert samples[0].meta["entry_point"] == "has_close_elements"


def test_humaneval_from_a_file():
    samples = HumanEval(data_files=str(LOCAL / "humaneval_one.jsonl")).load()
    assert [(s.id, s.prompt) for s in samples] == [("Toy/0", 'def add(a, b):\n    """Return a + b."""\n')]


# ---------------------------------------------------------------- selection determinism


def test_shots_are_deterministic_and_use_their_own_seed():
    def shots(seed):
        task = GSM8K(data_files=str(LOCAL / "gsm8k_test.jsonl"), shots_files=str(LOCAL / "gsm8k_train.jsonl"),
                     n_shot=2, shot_seed=seed)
        return [s["question"] for s in task.shots()]

    assert shots(42) == ["Q4?", "Q3?"] == shots(42)
    assert shots(1) == ["Q5?", "Q1?"]
    # The run's sample-selection seed does not move the shots.
    task = GSM8K(data_files=str(LOCAL / "gsm8k_test.jsonl"), shots_files=str(LOCAL / "gsm8k_train.jsonl"), n_shot=2)
    assert {s.prompt.split("\n\nQuestion: A")[0] for seed in (0, 7) for s in task.select(1, seed)} == \
        {"Question: Q4?\nAnswer: A4\n#### 4\nQuestion: Q3?\nAnswer: A3\n#### 3"}


def test_select_limit_seed_and_task_default_n():
    task = XSum(data_files=str(LOCAL / "xsum.jsonl"), n=1)
    assert len(task.select(None, 0)) == 1  # the task's n when the run sets no limit
    assert len(task.select(2, 0)) == 2  # the run's limit wins
    assert [s.id for s in task.select(1, 3)] == [s.id for s in task.select(1, 3)]
    assert {s.id for seed in range(20) for s in task.select(1, seed)} == {"101", "102"}


# ---------------------------------------------------------------- scoring hand-made outputs


def test_summary_scores_rouge2():
    task = XSum(data_files=str(LOCAL / "xsum.jsonl"))
    sample = task.load()[0]
    assert task.score(sample, " A park was approved.") == {"rouge2": pytest.approx(1.0)}
    assert task.score(sample, " a PARK was built") == {"rouge2": pytest.approx(2 / 3)}  # 2 of 3 bigrams each side


def test_gsm8k_score_and_aggregate():
    task = GSM8K(data_files=str(LOCAL / "gsm8k_test.jsonl"), shots_files=str(LOCAL / "gsm8k_train.jsonl"))
    sample = task.load()[1]
    right = task.score(sample, " 2*1200=2400\n#### 2,400\n\nQuestion: Q9?\nAnswer: 9\n#### 9")
    wrong = task.score(sample, " It is 2400 pins.\n#### 240")
    assert (right["correct"], right["correct_flexible"]) == (1.0, 1.0)
    assert (wrong["correct"], wrong["correct_flexible"]) == (0.0, 0.0)
    scored = [{"sample_id": "1", "repeat": 0, **right}, {"sample_id": "0", "repeat": 0, **wrong}]
    assert task.aggregate(scored)["correct"] == 0.5


def test_aqua_score():
    task = AquaRat(data_files=str(LOCAL / "aqua_test.jsonl"), fewshot_file=str(LOCAL / "aqua_shots.txt"))
    sample = task.load()[0]
    assert task.score(sample, " 2+3 = 5. So the answer is (b).\n\nQ: What")["correct"] == 1.0
    assert task.score(sample, " 2+3 = 6. So the answer is (c).")["correct"] == 0.0


def test_wmt14_score_and_corpus_bleu():
    task = Wmt14DeEn(data_files=str(LOCAL / "wmt14.jsonl"))
    samples = task.load()
    exact = task.score(samples[1], " The house is small.\nGerman: Noch ein Satz.")  # BLEU on the first line
    assert exact["sentence_bleu"] == pytest.approx(100.0)
    other = task.score(samples[0], " Hello there.")
    summary = task.aggregate([{"sample_id": "1", "repeat": 0, **exact}, {"sample_id": "0", "repeat": 0, **other}])
    assert set(summary) == {"bleu", "sentence_bleu", "rouge2"}
    assert 0 < summary["bleu"] < 100


def test_humaneval_score_and_pass_at_k():
    task = HumanEval(data_files=str(LOCAL / "humaneval_one.jsonl"), timeout=2.0)
    sample = task.load()[0]
    assert task.score(sample, "    return a + b\n\n\ndef extra():\n    syntax error here\n")["passed"] == 1.0
    assert task.score(sample, "    return a * b\n")["passed"] == 0.0
    # pass@10 runs: 10 outputs per prompt (repeat 0..9), grouped by sample_id.
    scored = [{"sample_id": sid, "repeat": r, "passed": float(r < c), "rouge2": 0.5}
              for sid, c in (("A", 2), ("B", 0)) for r in range(10)]
    assert task.aggregate(scored) == {"pass@1": pytest.approx(0.1), "pass@10": pytest.approx(0.5),
                                      "rouge2": pytest.approx(0.5)}


# ---------------------------------------------------------------- clear errors


def test_missing_data_file(tmp_path, hub_offline):
    with pytest.raises(TaskError, match=r"task gsm8k: cannot read task\.data_files=.*nope\.jsonl.*task\.data_files="):
        GSM8K(data_files=str(tmp_path / "nope.jsonl")).load()


def test_malformed_json_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"document": "a", "summary": "b", "id": "1"}\n{"document": oops}\n')
    with pytest.raises(TaskError, match=r"task xsum: cannot read .*bad\.jsonl.*JSON parse error"):
        XSum(data_files=str(bad)).load()


def test_record_without_a_field(tmp_path):
    bad = tmp_path / "gsm.jsonl"
    bad.write_text('{"question": "a?", "answer": "#### 1"}\n{"question": "b?"}\n')
    with pytest.raises(TaskError, match=r"task gsm8k: record 1 of .* has no answer .*task\.data_files="):
        GSM8K(data_files=str(bad), n_shot=0).load()


def test_unreachable_hub_names_task_id_and_way_out(hub_offline):
    with pytest.raises(TaskError, match=r"task xsum: cannot load 'EdinburghNLP/xsum' .*add data=local .*"
                                        r"task\.data_files="):
        XSum().load()


def test_unreachable_hub_for_shots_names_shots_files(hub_offline):
    task = GSM8K(data_files=str(LOCAL / "gsm8k_test.jsonl"))
    with pytest.raises(TaskError, match=r"task gsm8k: cannot load 'openai/gsm8k' \(config 'main'\) split 'train'"
                                        r".*task\.shots_files="):
        task.load()


def test_aqua_without_prompt_file():
    with pytest.raises(TaskError, match=r"task aqua_rat: .*task\.fewshot_file=.*aqua_cot_prompts_5shot\.txt"):
        AquaRat(data_files=str(LOCAL / "aqua_test.jsonl")).load()


# ---------------------------------------------------------------- configs


@pytest.mark.parametrize("name", PAPER_TASKS)
def test_task_config(name):
    path = CONFIGS / f"{name}.yaml"
    first = path.read_text().splitlines()[0]
    assert first.startswith("# ") and len(first) > 10  # the line `ls` prints
    cfg = OmegaConf.load(path)
    assert cfg.name == name
    assert cfg.data_files is None and list(cfg.stop_strings) == []  # hub by default; no stops, as the paper
    # Every key is a constructor argument somewhere in the class hierarchy (Task swallows unknown keys,
    # so a typo would otherwise pass silently).
    cls = get_class(cfg._target_)
    known = {p for klass in cls.__mro__ if klass is not object for p in inspect.signature(klass.__init__).parameters}
    assert set(cfg) - RUNNER_KEYS <= known
    task = instantiate(cfg)
    assert isinstance(task, Task) and task.name == name and task.version


def test_pass10_config_generation():
    cfg = OmegaConf.load(CONFIGS / "humaneval_pass10.yaml")
    assert cfg.samples_per_prompt == 10
    assert OmegaConf.to_container(cfg.generation) == {"do_sample": True, "temperature": 0.6, "top_p": 0.95}


# ---------------------------------------------------------------- the offline copies in ../shared/data

OFFLINE = {
    "cnndm_lm": {"data_files": "cnn_dailymail/test_specbench80.jsonl"},
    "cnndm_sum": {"data_files": "cnn_dailymail/test_specbench80.jsonl",
                  "shots_files": "cnn_dailymail/test_specbench80.jsonl"},
    "xsum": {"data_files": "xsum/test.jsonl"},
    "gsm8k": {"data_files": "gsm8k/test.jsonl", "shots_files": "gsm8k/train.jsonl"},
    "aqua_rat": {"data_files": "aqua_rat/test.jsonl",
                 "fewshot_file": "aqua_rat/fewshot_sirius/aqua_cot_prompts_5shot.txt"},
    "wmt14_de_en": {"data_files": "wmt14/test.jsonl"},
}
COUNTS = {"cnndm_lm": 80, "cnndm_sum": 79, "xsum": 1000, "gsm8k": 1000, "aqua_rat": 254, "wmt14_de_en": 1000}


def offline_task(name):
    overrides = {k: str(SHARED / v) for k, v in OFFLINE[name].items()}
    return instantiate(OmegaConf.merge(OmegaConf.load(CONFIGS / f"{name}.yaml"), overrides))


@needs_shared
@pytest.mark.parametrize("name", sorted(OFFLINE))
def test_offline_copies_load(name):
    task = offline_task(name)
    samples = task.load()
    assert len(samples) == COUNTS[name]
    assert len({s.id for s in samples}) == len(samples)
    picked = task.select(2, 42)
    assert len(picked) == 2 and [s.id for s in picked] == [s.id for s in task.select(2, 42)]
    for s in picked:  # a perfect output scores as such
        scores = task.score(s, s.reference)
        assert scores["rouge2"] == pytest.approx(1.0)


@needs_shared
def test_offline_gsm8k_shots():
    shots = offline_task("gsm8k").shots()
    assert [s["question"].split(".")[0] for s in shots] == [
        "Stephen has 110 ants in his ant farm", "John climbs 3 staircases",
        "The gummy bear factory manufactures 300 gummy bears a minute",
        "The age difference between Asaf and Alexander's age is half the total number of pencils Asaf has",
        "Three cats sat on a fence, meowing at the moon"]


@needs_shared
def test_offline_aqua_uses_the_sirius_file_as_is():
    sample = offline_task("aqua_rat").load()[0]
    # The repeated exemplar stays twice, once answered (c) and once (a), as in the authors' runs.
    assert sample.prompt.count("There are k-2 members in a certain band") == 2
    assert sample.prompt.startswith("Q: Two friends plan to walk along a 43-km trail")
    assert "k = 8. So the answer is (a).\n\nQ: A car is being driven, in a straight line" in sample.prompt
    assert sample.prompt.endswith("(e) None of these\nA:")


@needs_shared
def test_offline_cnndm_sum_shot_left_out():
    task = offline_task("cnndm_sum")
    shot = task.shots()[0]
    assert shot["specbench_question_id"] == 274
    assert all(shot["article"] not in s.prompt.split("\n\nArticle: ")[-1] for s in task.load())
