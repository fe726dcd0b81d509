"""del-bench as an lm-evaluation-harness model (del_bench/lm_eval_backend.py): lm-eval runs end to end through
`--model del_bench` on the testbed with Vanilla and LS (equal scores, our records readable by `show`, both result
sets pointing at each other); the likelihoods are the full model's (held to transformers' forward in float64);
generation honours `until`, `max_gen_toks` and sampling, resumes without losing or repeating a generation and refuses
changed prompts; the offline task files are lm-eval's own but for their data (and HumanEval's sandbox)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
import yaml

lm_eval = pytest.importorskip("lm_eval")  # the optional extra `lm-eval` (make setup installs it)

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window  # noqa: E402

from del_bench import lm_eval_backend as backend  # noqa: E402
from del_bench.__main__ import cmd_lm_eval, cmd_show  # noqa: E402
from del_bench.errors import ConfigError, RunConflict  # noqa: E402
from del_bench.lm_eval_tasks import TASKS_DIR, utils  # noqa: E402
from del_bench.records import RunDir, read_jsonl  # noqa: E402
from del_bench.tasks.base import Sample  # noqa: E402
from del_bench.tasks.humaneval import HumanEval  # noqa: E402

TINY = {"model": "tiny-random", "threads": 1, "layers": "eager", "products": "wt_x", "warmup_tokens": 0}
TASKS = "del_bench_tiny_code,del_bench_tiny_choice,del_bench_tiny_text"


def tiny_lm(tmp_path: Path, **args) -> backend.DelBenchLM:
    return backend.DelBenchLM(**{**TINY, "records_root": str(tmp_path / "runs"), **args})


def request(kind: str, arguments: tuple, doc_id: int = 0, task: str = "t", idx: int = 0) -> Instance:
    return Instance(request_type=kind, doc={}, arguments=arguments, idx=idx, metadata=(task, doc_id, 1))


# ---- end to end: lm-eval → our backend → records ------------------------------------------------------------------
@pytest.fixture(scope="module")
def testbed_evaluations(tmp_path_factory):
    """lm-eval with `--model del_bench` on the testbed, on a generation task and two likelihood tasks of our offline
    task files: Vanilla through our command line (lm-eval's own, then `link`), LS through lm-eval's simple_evaluate
    in Python (then `link`): {method: (results, results file or None)}."""
    from lm_eval.tasks import TaskManager

    tmp = tmp_path_factory.mktemp("lm_eval")
    settings = f"model=testbed,layers=eager,products=wt_x,threads=1,records_root={tmp / 'runs'}"
    argv = sys.argv[:]
    try:
        assert cmd_lm_eval(["--model", "del_bench", "--model_args", f"{settings},method=vanilla", "--tasks", TASKS,
                            "--output_path", str(tmp / "results")]) == 0
    finally:
        sys.argv = argv
    ls = lm_eval.simple_evaluate(model="del_bench", model_args=f"{settings},method=ls", tasks=TASKS.split(","),
                                 log_samples=True, task_manager=TaskManager(include_path=str(TASKS_DIR),
                                                                            include_defaults=False))
    backend.link(ls)
    return {"vanilla": backend.saved_results(tmp / "results", 0), "ls": (ls, None)}


def test_lm_eval_through_del_bench_scores_every_method_alike(testbed_evaluations):
    """lossless means identical scores: LS's generations, likelihoods and so every metric equal Vanilla's."""
    (vanilla, _), (ls, _) = testbed_evaluations["vanilla"], testbed_evaluations["ls"]
    assert set(vanilla["results"]) == set(TASKS.split(","))
    for task in TASKS.split(","):
        assert backend.task_metrics(ls["results"][task]) == backend.task_metrics(vanilla["results"][task]), task
    assert vanilla["results"]["del_bench_tiny_choice"]["acc,none"] is not None
    assert 0 < vanilla["results"]["del_bench_tiny_text"]["bits_per_byte,none"] < 10  # a real perplexity


def test_lm_eval_generations_are_our_records(testbed_evaluations, capsys):
    """Each generation is a SampleRecord of a run of ours (task = lm-eval's, sample id = doc_id), its text as lm-eval
    scored it (cut at `until`); the LS run drafted and its outputs are Vanilla's token for token; `show` reads both
    runs and pairs them; each result set names our run and our summary names its results file."""
    runs = {}
    for method, (results, path) in testbed_evaluations.items():
        run = results["config"]["del_bench"]["runs"]["del_bench_tiny_code"]
        summary = json.loads((Path(run) / "summary.json").read_text())
        assert summary["lm_eval"]["results"] == (str(path) if path else None)  # a file where lm-eval saved one
        assert summary["task"] == "del_bench_tiny_code"
        assert summary["quality"] == backend.task_metrics(results["results"]["del_bench_tiny_code"])
        records = {r["sample_id"]: r for r in read_jsonl(Path(run) / "samples.jsonl")}
        logged = results["samples"]["del_bench_tiny_code"]
        assert sorted(records) == sorted(str(s["doc_id"]) for s in logged) == ["0", "1", "2", "3"]
        for sample in logged:
            record = records[str(sample["doc_id"])]
            assert record["prompt"] == sample["doc"]["prompt"]  # doc_to_text: the prompt verbatim
            assert sample["resps"][0][0] == record["output_text"].split("\n\n")[0]  # until: ["\n\n"]
            assert record["generated_tokens"] <= 32  # max_gen_toks
            assert record["scores"] == {"exact_match,none": sample["exact_match"]}
        runs[method] = (run, records)
    (vanilla_dir, vanilla), (ls_dir, ls) = runs["vanilla"], runs["ls"]
    assert all(ls[i]["output_ids"] == vanilla[i]["output_ids"] for i in vanilla)
    assert sum(r["drafted"] for r in ls.values()) > 0  # LS really drafted
    assert cmd_show([vanilla_dir, ls_dir]) == 0
    table = capsys.readouterr().out
    assert "LS(E6-γ2)" in table and "Vanilla" in table and "n/a" not in table  # paired: a speedup, not n/a


# ---- likelihoods: the full model ------------------------------------------------------------------------------------
def reference_logprob(model, context_ids: list[int], continuation_ids: list[int]) -> tuple[float, bool]:
    """transformers' forward (float64): log P(continuation | context), and whether greedy gives the continuation."""
    ids = torch.tensor([context_ids + continuation_ids[:-1]])
    logprobs = model(ids).logits[0, -len(continuation_ids):].log_softmax(-1)  # [n, V]
    target = torch.tensor(continuation_ids)
    return float(logprobs.gather(-1, target[:, None]).sum()), bool((logprobs.argmax(-1) == target).all())


def byte_ids(text: str) -> list[int]:
    return [b + 3 for b in text.encode()]  # tiny-random's ByteTokenizer: bytes 3..258, <s> = 1


@torch.inference_mode()
def test_loglikelihood_is_the_full_models(tmp_path):
    """(context, continuation) scored through all L layers, for an LS config too: lm-eval's split (trailing spaces go to
    the continuation; an empty context conditions on BOS) and transformers' forward agree to float64 rounding."""
    lm = tiny_lm(tmp_path, method="ls")
    pairs = [("def f(x):", " return x"), ("a b ", "c d"), ("", "xyz")]
    got = lm.loglikelihood([request("loglikelihood", pair) for pair in pairs])
    expected = [reference_logprob(lm.loaded.model, [1] + byte_ids("def f(x):"), byte_ids(" return x")),
                reference_logprob(lm.loaded.model, [1] + byte_ids("a b"), byte_ids(" c d")),
                reference_logprob(lm.loaded.model, [1], byte_ids("xyz"))]
    for (logprob, greedy), (want, want_greedy) in zip(got, expected):
        assert logprob == pytest.approx(want, rel=1e-10) and greedy == want_greedy
    # the continuation the model itself writes is greedy; with its last token changed it is not
    context = [1] + byte_ids("abc")
    written = lm.loaded.model.generate(torch.tensor([context]), max_new_tokens=4, do_sample=False)[0, 4:].tolist()
    other = written[:-1] + [written[-1] % 200 + 3 + (written[-1] % 200 + 3 == written[-1])]
    assert [g for _, g in lm._loglikelihood_tokens([(None, context, written), (None, context, other)])] == [True, False]


@torch.inference_mode()
def test_loglikelihood_rolling_sums_lm_evals_windows(tmp_path):
    """A text's log-likelihood: every token once, in lm-eval's disjoint windows of max_length (16 here, so the text
    spans several), each window scored by the full model."""
    lm = tiny_lm(tmp_path, **{"+model.max_position_embeddings": 16})
    text = "import sys\nprint(sys.argv)\n"
    tokens = [1] + byte_ids(text)  # the tokenizer's own encoding (it adds <s>), as lm-eval's HF backend
    windows = list(map(make_disjoint_window, get_rolling_token_windows(tokens, 1, 16, 1)))
    assert len(windows) >= 2
    expected = math.fsum(reference_logprob(lm.loaded.model, c, t)[0] for c, t in windows)
    (short,) = lm.loglikelihood_rolling([request("loglikelihood_rolling", ("ab",))])
    assert lm.loglikelihood_rolling([request("loglikelihood_rolling", (text,))])[0] == pytest.approx(expected, 1e-10)
    assert short == pytest.approx(reference_logprob(lm.loaded.model, [1], [1] + byte_ids("ab"))[0], rel=1e-10)


# ---- generation: our engine and records ---------------------------------------------------------------------------
UNTIL = ["e", "t", "a", "o", "i", "n", " "]


def generate(lm, prompts: list[str], **gen_kwargs) -> list[str]:
    kwargs = {"until": UNTIL, "max_gen_toks": 12, **gen_kwargs}
    return lm.generate_until([request("generate_until", (p, kwargs), doc_id=i, task="gen")
                              for i, p in enumerate(prompts)])


PROMPTS = ["def main():", "class A:", "import os", "x = 1"]


def test_generate_until_honours_until_and_max_gen_toks(tmp_path):
    """The text handed back is the output cut at the first `until` string, decoding stopped there (nothing after the
    stop string's end) and never past max_gen_toks; lm-eval's task and doc ids are the run's task and sample ids.
    (The random model writes mostly bytes outside ASCII: one of these prompts meets a stop string.)"""
    lm = tiny_lm(tmp_path, method="ls")
    texts = generate(lm, PROMPTS)
    run = RunDir(lm.runs["gen"])
    records = {r["sample_id"]: r for r in run.finished()}
    assert sorted(records) == ["0", "1", "2", "3"] and json.loads(run.summary_path.read_text())["task"] == "gen"
    stopped = 0
    for i, text in enumerate(texts):
        output, record = records[str(i)]["output_text"], records[str(i)]
        assert record["generated_tokens"] <= 12 and record["prompt"] == PROMPTS[i]
        ends = [output.find(s) + len(s) for s in UNTIL if s in output]
        assert text == output[:min(ends) - 1] if ends else text == output  # every stop string is one byte here
        if ends:
            stopped += 1
            assert min(ends) == len(output)  # decoding ended with the stop string
        else:
            assert record["generated_tokens"] == 12 or record["output_ids"][-1] == 2  # max_gen_toks, or EOS
    assert stopped and any(r["generated_tokens"] == 12 for r in records.values())  # both ways of ending ran


def test_an_interrupted_run_resumes_without_losing_or_repeating(tmp_path):
    """Killed after its first generation, the rerun decodes the other three only; every generation is in samples.jsonl
    once, with its rounds once, and the texts are an uninterrupted run's. A changed prompt under a recorded id is
    refused, and so are other settings in the same directory."""
    full = generate(tiny_lm(tmp_path / "a"), PROMPTS)
    lm = tiny_lm(tmp_path / "b")
    generate(lm, PROMPTS)
    run = RunDir(lm.runs["gen"])
    first = run.samples_path.read_text().splitlines()[0]
    run.samples_path.write_text(first + "\n" + '{"torn": ')  # one finished, one torn line
    run.summary_path.unlink()
    assert generate(tiny_lm(tmp_path / "b"), PROMPTS) == full
    records = run.finished()
    assert sorted(r["sample_id"] for r in records) == ["0", "1", "2", "3"]
    assert records[0] == json.loads(first)  # kept, not decoded again
    rounds = [(r["sample_id"], r["round"]) for r in run.rounds()]
    assert len(rounds) == len(set(rounds)) == sum(r["rounds"] for r in records)
    with pytest.raises(RunConflict, match="another prompt"):
        generate(tiny_lm(tmp_path / "b"), ["def other():", *PROMPTS[1:]])
    with pytest.raises(RunConflict, match="model differ.*records_root="):  # other settings, the same directory
        generate(tiny_lm(tmp_path / "b", **{"model.dtype": "float32"}), PROMPTS)


def test_sampled_requests_decode_by_speculative_sampling(tmp_path):
    """gen_kwargs that sample make a sampled run (its decoding, its own directory); repeats are outputs of their own,
    each with its seed; the same requests draw the same tokens again."""
    kwargs = {"until": [], "max_gen_toks": 8, "do_sample": True, "temperature": 0.7}
    twice = [request("generate_until", ("abc", kwargs), task="s")] * 2  # lm-eval lists a request once per repeat
    lm = tiny_lm(tmp_path / "a", method="ls")
    texts = lm.generate_until(twice)
    assert lm.runs["s"].endswith("sample-t0.7-p1.0-max8-seed42")
    records = RunDir(lm.runs["s"]).finished()
    assert [(r["sample_id"], r["repeat"]) for r in records] == [("0", 0), ("0", 1)]
    assert texts[0] != texts[1]
    assert tiny_lm(tmp_path / "b", method="ls").generate_until(twice) == texts


@pytest.mark.parametrize("args, message", [
    ({"generation.do_sample": True}, "gen_kwargs decide"),
    ({"out_dir": "x"}, "records_root"),
    ({"limit": 3}, "--limit"),
    ({"batch_size": 4}, "batch 1"),
    ({"method": "lss"}, "Did you mean 'ls'"),
    ({"method.gama": 2}, "gama"),
])
def test_bad_model_args_get_a_clear_error(tmp_path, args, message):
    with pytest.raises(ConfigError, match=message):
        tiny_lm(tmp_path, **args)


def test_gen_kwargs_the_engine_cannot_honour_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="top_k"):
        generate(tiny_lm(tmp_path), PROMPTS[:1], top_k=5)


# ---- the offline task files --------------------------------------------------------------------------------------
def task_file(path: Path) -> dict:
    class Loader(yaml.SafeLoader):
        pass

    Loader.add_constructor("!function", lambda loader, node: f"!function {loader.construct_scalar(node)}")
    return yaml.load(path.read_text(), Loader=Loader)


@pytest.mark.parametrize("ours, theirs, differences", [
    ("gsm8k_local.yaml", "gsm8k/gsm8k.yaml", {"task", "tag", "dataset_path", "dataset_name", "custom_dataset"}),
    ("humaneval_sandbox.yaml", "humaneval/humaneval.yaml",
     {"task", "dataset_path", "custom_dataset", "unsafe_code", "metric_list", "process_results", "filter_list"}),
])
def test_task_files_are_lm_evals_own_but_for_data_and_sandbox(ours, theirs, differences):
    """gsm8k_local is lm-eval's gsm8k field for field but where its data come from; humaneval_sandbox is lm-eval's
    humaneval but for its data and who runs the programs (prompt, stop strings, max_gen_toks are the same)."""
    mine = task_file(TASKS_DIR / ours)
    original = task_file(Path(lm_eval.__file__).parent / "tasks" / theirs)
    keys = (set(mine) | set(original)) - differences
    assert {k: mine.get(k) for k in keys} == {k: original.get(k) for k in keys}


def test_humaneval_sandbox_scores_as_our_humaneval_task():
    """humaneval_sandbox's pass@1 and our task's `passed` agree on the same completions: the canonical solution
    passes, a wrong body fails, in our sandbox both."""
    problems = utils.humaneval()["test"]
    ours = HumanEval(score_workers=1)
    for doc in (problems[0], problems[2]):
        sample = Sample(id=doc["task_id"], prompt=doc["prompt"], reference=doc["canonical_solution"],
                        meta={"entry_point": doc["entry_point"], "test": doc["test"]})
        for completion, passed in ((doc["canonical_solution"], 1.0), ("    return None\n", 0.0)):
            assert utils.humaneval_pass(doc, [completion]) == {"pass@1": passed}
            assert ours.score_batch([(sample, completion)])[0]["passed"] == passed


def test_gsm8k_local_reads_the_offline_copies(tmp_path):
    (tmp_path / "gsm8k").mkdir()
    for split in ("test", "train"):
        (tmp_path / "gsm8k" / f"{split}.jsonl").write_text(json.dumps({"question": "1+1?", "answer": "#### 2"}) + "\n")
    data = utils.gsm8k(data_dir=str(tmp_path), model="testbed")  # lm-eval passes model_args along
    assert data["test"][0] == {"question": "1+1?", "answer": "#### 2"} and len(data["train"]) == 1
    with pytest.raises(FileNotFoundError, match="data_dir="):
        utils.gsm8k(data_dir=str(tmp_path / "nowhere"))


def test_crosscheck_finds_where_lm_evals_gsm8k_scoring_and_ours_differ(tmp_path):
    """lm-eval's own gsm8k scoring (gsm8k_local: its filters and exact_match) of scripted outputs beside our task
    file's: they agree but where lm-eval compares strings and we compare numbers ("72.00" is 72 for us, not for it)."""
    from lm_eval.api.model import LM
    from lm_eval.tasks import TaskManager

    from del_bench import lm_eval_crosscheck

    outputs = [" 36 + 36 = 72\n#### 72", " 72.00 dollars\n#### 72.00", " The total is $1,000.", " #### 5"]
    answers = ["#### 72", "#### 72", "#### 1000", "#### 6"]

    class Scripted(LM):
        def generate_until(self, requests, disable_tqdm=False):
            return [outputs[r.doc_id] for r in requests]

        def loglikelihood(self, requests):
            raise NotImplementedError

        def loglikelihood_rolling(self, requests):
            raise NotImplementedError

    (tmp_path / "gsm8k").mkdir()
    for split, rows in (("test", answers), ("train", ["#### 1"] * 5)):
        (tmp_path / "gsm8k" / f"{split}.jsonl").write_text(
            "".join(json.dumps({"question": f"q{i}?", "answer": a}) + "\n" for i, a in enumerate(rows)))
    manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False, metadata={"data_dir": str(tmp_path)})
    results = lm_eval.simple_evaluate(model=Scripted(), tasks=["gsm8k_local"], log_samples=True, task_manager=manager)
    checks = {c.metric.split(",")[1].split(" ")[0]: c for c in lm_eval_crosscheck.check_results(results)}
    assert set(checks) == {"strict-match", "flexible-extract"} and all(c.docs == 4 for c in checks.values())
    assert checks["strict-match"].disagree == checks["flexible-extract"].disagree == ["1"]
    assert (checks["strict-match"].lm_eval, checks["strict-match"].ours) == (0.25, 0.5)
    assert (checks["flexible-extract"].lm_eval, checks["flexible-extract"].ours) == (0.5, 0.75)


def test_our_command_line_fills_in_lm_evals_defaults_only_where_missing():
    """`python -m del_bench lm-eval` adds --model del_bench, our task files, an output path and --log_samples (the
    per-document scores our records take) where they are not given, and never overrides one that is."""
    assert backend.with_defaults(["--tasks", "gsm8k_local"]) == [
        "--tasks", "gsm8k_local", "--include_path", str(TASKS_DIR), "--model", "del_bench",
        "--output_path", backend.DEFAULT_OUTPUT, "--log_samples"]
    given = ["--model=hf", "--include_path", "mine", "-o", "out.json", "--predict_only", "--tasks", "x"]
    assert backend.with_defaults(given) == given
    assert backend.with_defaults(["ls", "tasks"]) == ["ls", "tasks", "--include_path", str(TASKS_DIR)]


def test_link_finds_each_documents_scores_under_samples_too(tmp_path):
    """Under lm-eval's --samples a request's doc_id (our sample id) is its position among the documents chosen, the
    logged sample's the document's index: link matches them by prompt, so every record gets its own document's
    scores."""
    from lm_eval.tasks import TaskManager

    args = ",".join(f"{k}={v}" for k, v in {**TINY, "records_root": tmp_path / "runs"}.items())
    results = lm_eval.simple_evaluate(model="del_bench", model_args=args, tasks=["del_bench_tiny_code"],
                                      samples={"del_bench_tiny_code": [1, 3]}, log_samples=True,
                                      task_manager=TaskManager(include_path=str(TASKS_DIR), include_defaults=False))
    (run,) = backend.link(results)
    docs = utils.tiny_code()["test"]
    logged = {s["doc_id"]: s for s in results["samples"]["del_bench_tiny_code"]}
    assert sorted(logged) == [1, 3]
    records = {r["sample_id"]: r for r in RunDir(run).finished()}
    assert sorted(records) == ["0", "1"]
    for sample_id, doc_id in (("0", 1), ("1", 3)):
        assert records[sample_id]["prompt"] == docs[doc_id]["prompt"]
        assert records[sample_id]["scores"] == {"exact_match,none": logged[doc_id]["exact_match"]}
    assert json.loads((Path(run) / "summary.json").read_text())["lm_eval"]["documents_scored"] == 2
