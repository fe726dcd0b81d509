"""The harness around the engine: configs compose, bad input fails early and clearly, records are
recomputable, and an interrupted run resumes without losing or duplicating samples."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from del_bench import jobs, runner, tracking
from del_bench.__main__ import cmd_run
from del_bench.config import ConfigError, check_overrides, choices, resolve_aliases, validate
from del_bench.engine.decode import Engine
from del_bench.engine.path_choice import stack_of
from del_bench.methods.dv import DraftVerify
from del_bench.models import loading
from del_bench.records import RunConflict, RunDir
from tests.conftest import compose_run

PAPER_MODELS = {  # name: (hub id, layers, sharded over GPUs)
    "llama3.2-1b": ("facebook/layerskip-llama3.2-1B", 16, False),
    "llama3-8b": ("facebook/layerskip-llama3-8B", 32, False),
    "llama2-7b": ("facebook/layerskip-llama2-7B", 32, False),
    "llama2-13b": ("facebook/layerskip-llama2-13B", 40, False),
    "llama2-70b": ("facebook/layerskip-llama2-70B", 80, True),
    "codellama-7b": ("facebook/layerskip-codellama-7B", 32, False),
    "codellama-34b": ("facebook/layerskip-codellama-34B", 48, True),
}


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("name", sorted(PAPER_MODELS))
def test_paper_model_configs_compose_without_loading(name):
    hf_id, layers, sharded = PAPER_MODELS[name]
    cfg = compose_run(f"model={name}", "method=ls")
    assert (cfg.model.hf_id, cfg.model.num_layers, cfg.model.source) == (hf_id, layers, "hub")
    assert cfg.model.dtype in ("bfloat16", "float16")
    assert (cfg.model.device_map == "auto") == sharded
    validate(cfg)  # the default LS(E, γ) of every model is valid for its depth
    assert cfg.method.tag == f"ls-E{cfg.model.default_exit_layer}-g{cfg.model.default_gamma}"


def test_defaults_are_the_embedded_model_and_task():
    cfg = compose_run()
    assert (cfg.model.name, cfg.task.name) == ("smollm2-135m", "humaneval")
    assert cfg.out_dir.startswith("results/runs/smollm2-135m/humaneval/")


@pytest.mark.parametrize("group,typo,suggestion", [
    ("model", "smollm2", "smollm2-135m"), ("task", "humaneva", "humaneval"), ("method", "vanila", "vanilla"),
])
def test_unknown_names_suggest_the_right_one(group, typo, suggestion):
    with pytest.raises(ConfigError, match=f"Did you mean '{suggestion}'"):
        check_overrides([f"{group}={typo}"])


@pytest.mark.parametrize("override,message", [
    ("method.exit_layer=4", r"method.exit_layer=4: must be an integer in \[1, L − 1\], here \[1, 3\]"),  # E = L
    ("method.exit_layer=0", r"method.exit_layer=0: must be an integer in \[1, L − 1\]"),
    ("method.gamma=-1", r"method.gamma=-1: must be an integer ≥ 1"),
    ("generation.top_p=0", r"generation.top_p=0: must be a number in \(0, 1\]"),
    ("limit=0", r"limit=0: must be an integer ≥ 1, or null"),
    ("method=dv method.theta=1.5", r"method.theta=1.5: must be a number in \[0, 1\]"),
    ("method=fs method.exit_layer=9", r"method.exit_layer=9: must be an integer in \[1, L − 1\], here \[1, 3\]"),
    ("layers=fusd", r"layers='fusd': must be one of auto, fused, eager .*Did you mean 'fused'\?"),
])
def test_invalid_hyperparameters_fail_before_the_model_loads(run_cfg, monkeypatch, override, message):
    def no_loading(_):
        raise AssertionError("the model was loaded before validation")

    monkeypatch.setattr(loading, "load", no_loading)
    overrides = override.split(" ")
    if not overrides[0].startswith("method="):
        overrides.insert(0, "method=ls")
    with pytest.raises(ConfigError, match=message):
        runner.run(run_cfg(*overrides))


def test_cli_reports_unknown_method_with_suggestion():
    done = subprocess.run([sys.executable, "-m", "del_bench", "run", "method=lss"], capture_output=True, text=True)
    assert done.returncode == 2
    assert "unknown method 'lss'. Did you mean 'ls'" in done.stderr


def test_cli_ls_lists_every_config():
    done = subprocess.run([sys.executable, "-m", "del_bench", "ls"], capture_output=True, text=True, check=True)
    for group in ("model", "task", "method"):
        for name in choices(group):
            assert name in done.stdout


def test_records_recompute_the_summary(run_cfg):
    cfg = run_cfg("method=ls", "method.exit_layer=1", "method.gamma=3")
    summary = runner.run(cfg)
    run_dir = RunDir(cfg.out_dir)
    samples, rounds = read_jsonl(run_dir.samples_path), read_jsonl(run_dir.rounds_path)
    assert summary["n_samples"] == len(samples) == 3
    L = cfg.model.num_layers
    for s in samples:
        mine = [r for r in rounds if r["sample_id"] == s["sample_id"]]
        layers = sum(r["drafted"] * r["exit_layer"] + L if r["drafted"] else L for r in mine)
        assert s["loaded_layers"] == layers
        assert s["etpl"] == s["generated_tokens"] / layers
        assert s["generated_tokens"] == sum(r["emitted"] for r in mine) == len(s["output_ids"])
        assert s["accepted"] == sum(r["accepted"] for r in mine) and s["drafted"] == sum(r["drafted"] for r in mine)
    assert summary["etpl"] == pytest.approx(sum(s["etpl"] for s in samples) / 3)
    assert summary["acceptance_rate"] == sum(s["accepted"] for s in samples) / sum(s["drafted"] for s in samples)
    assert 0 < summary["acceptance_rate"] < 1


def test_vanilla_etpl_is_exactly_one_over_L(run_cfg):
    summary = runner.run(run_cfg("method=vanilla"))
    assert summary["etpl"] == 1 / 4
    assert summary["acceptance_rate"] is None


def killed_on_call(n: int, cfg, monkeypatch) -> None:
    """Run cfg as if killed (KeyboardInterrupt) when its n-th generation begins (Engine.begin)."""
    real_begin, calls = Engine.begin, {"n": 0}

    def dies(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == n:
            raise KeyboardInterrupt
        return real_begin(self, *args, **kwargs)

    monkeypatch.setattr(Engine, "begin", dies)
    with pytest.raises(KeyboardInterrupt):
        runner.run(cfg)
    monkeypatch.setattr(Engine, "begin", real_begin)


def test_interrupted_run_resumes_without_loss_or_duplicates(run_cfg, monkeypatch):
    cfg = run_cfg("method=ls", "method.exit_layer=2", "method.gamma=2", "limit=4")
    fresh = runner.run(run_cfg("method=ls", "method.exit_layer=2", "method.gamma=2", "limit=4",
                               f"out_dir={cfg.out_dir}-fresh"))

    killed_on_call(3, cfg, monkeypatch)
    run_dir = RunDir(cfg.out_dir)
    assert len(read_jsonl(run_dir.samples_path)) == 2  # warm-up is off: calls 1 and 2 finished
    # a torn write: half a line at the end of both files, as a kill during write would leave
    with open(run_dir.rounds_path, "a") as f:
        f.write('{"sample_id": "HumanEval/999", "rou')
    with open(run_dir.samples_path, "a") as f:
        f.write('{"sample_id": "Hum')
    resumed = runner.run(cfg)

    samples = read_jsonl(run_dir.samples_path)
    ids = [s["sample_id"] for s in samples]
    assert len(ids) == len(set(ids)) == 4
    rounds = read_jsonl(run_dir.rounds_path)
    assert {r["sample_id"] for r in rounds} == set(ids)
    for s in samples:  # no sample's rounds were written twice
        assert sum(r["emitted"] for r in rounds if r["sample_id"] == s["sample_id"]) == s["generated_tokens"]
    assert resumed["n_samples"] == 4
    fresh_outputs = {s["sample_id"]: s["output_ids"] for s in read_jsonl(RunDir(f"{cfg.out_dir}-fresh").samples_path)}
    assert {s["sample_id"]: s["output_ids"] for s in samples} == fresh_outputs
    assert resumed["generated_tokens"] == fresh["generated_tokens"]


MEASURED = {  # measurements of time and memory, different in any two runs: blanked before records are compared
    "samples.jsonl": ("wall_s", "tokens_per_s", "peak_memory_bytes", "load", "ttft_s"),
    "rounds.jsonl": ("draft_s", "verify_s", "policy_s", "opt_s"),
}
# a method that carries state across prompts (θ), so a resume must also continue it from the right sample
KILLED_RUN = ("model=tiny-random", "method=dv", "method.exit_layer=2", "method.reset_per_prompt=false",
              "max_new_tokens=12", "warmup_tokens=0", "threads=1", "products=wt_x")
KILL_POINTS = {  # POINT: K, then the files as the kill leaves them: samples lines, samples in rounds, state's samples
    "decoded": (2, 1, 1, 1),  # mid-sample: the 2nd sample decoded, nothing of it written
    "method_state.json": (2, 1, 1, 2),  # mid-sample: the state after the 2nd sample written, none of its records
    "rounds.jsonl": (3, 2, 3, 3),  # between the two appends: the 3rd sample's rounds written, its sample line not
    "samples.jsonl": (2, 2, 2, 2),  # after both appends
}


def comparable_records(run_dir) -> dict[str, str]:
    """samples.jsonl and rounds.jsonl with MEASURED blanked (everything else byte for byte, in file order), and
    method_state.json."""
    out = {}
    for name, measured in MEASURED.items():
        rows = [json.loads(line) for line in (run_dir / name).read_text().splitlines()]
        out[name] = "".join(json.dumps({k: None if k in measured else v for k, v in r.items()}) + "\n" for r in rows)
    out["method_state.json"] = (run_dir / "method_state.json").read_text()
    return out


def tear_last_line(path) -> None:
    """Cut the file inside its last line, as a kill during that line's write leaves it."""
    data = path.read_bytes()
    path.write_bytes(data[:data.rstrip(b"\n").rfind(b"\n") + 20])


def test_sigkilled_run_resumes_to_the_records_of_an_uninterrupted_one(run_cfg, tmp_path):
    """A CLI run killed with SIGKILL at each KILL_POINT (and, at the two appends, the same with a torn last line)
    resumes to records identical to an uninterrupted run's but for MEASURED: no sample lost, no round duplicated,
    the cross-prompt state continued from the right sample."""
    prompts = tmp_path / "prompts.jsonl"  # task=prompts: the CLI skips HumanEval's scoring imports (seconds)
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p}) + "\n"
                               for i, p in enumerate(["Hello", "def f(x):", "The cat sat", "1, 2, 3,"])))
    overrides = (*KILLED_RUN, "task=prompts", f"task.data_files={prompts}", "limit=null")

    def out_dir(point):
        return tmp_path / point.split(".")[0]

    killed = {point: subprocess.Popen(  # all at once: each is mostly imports
        [sys.executable, "-m", "tests.killed_run", point, str(k), "run", *overrides, f"out_dir={out_dir(point)}"],
        cwd=Path(__file__).parent.parent, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        for point, (k, *_) in KILL_POINTS.items()}
    runner.run(run_cfg(*overrides, f"out_dir={tmp_path / 'whole'}"))
    whole = comparable_records(tmp_path / "whole")
    assert whole["samples.jsonl"].count("\n") == 4

    resume = []
    for point, (_, samples, round_samples, state_samples) in KILL_POINTS.items():
        stderr = killed[point].communicate()[1].decode()
        assert killed[point].returncode == -signal.SIGKILL, stderr[-2000:]
        run_dir = out_dir(point)
        assert len(read_jsonl(run_dir / "samples.jsonl")) == samples
        assert len({r["sample_id"] for r in read_jsonl(run_dir / "rounds.jsonl")}) == round_samples
        assert json.loads((run_dir / "method_state.json").read_text())["samples"] == state_samples
        resume.append(run_dir)
        if point.endswith(".jsonl"):  # the same kill during the write of the last line
            torn = tmp_path / f"{run_dir.name}-torn"
            shutil.copytree(run_dir, torn)
            tear_last_line(torn / point)
            resume.append(torn)
    for run_dir in resume:
        runner.run(run_cfg(*overrides, f"out_dir={run_dir}"))
        assert comparable_records(run_dir) == whole, run_dir.name


def test_resume_refuses_a_run_with_other_settings(run_cfg):
    cfg = run_cfg("method=vanilla", "limit=1")
    runner.run(cfg)
    with pytest.raises(RunConflict, match="max_new_tokens"):
        runner.run(run_cfg("method=vanilla", "limit=1", "max_new_tokens=8"))
    runner.run(run_cfg("method=vanilla", "limit=2"))  # a larger limit continues the same run


def test_a_run_resumes_after_its_models_ls_defaults_move(run_cfg):
    """model.default_exit_layer / default_gamma reach a run's results only as method.exit_layer / method.gamma (which
    its settings keep, resolved): a run that did not take them (here Vanilla), its run_config.json written with the
    old ones, still resumes and is still skipped as finished when the model config's defaults move; an LS that took
    them does not."""
    cfg = run_cfg("method=vanilla", "limit=1")
    runner.run(cfg)
    stored = RunDir(cfg.out_dir).config_path  # as records written before this rule hold it: with the defaults
    settings = json.loads(stored.read_text())
    settings["model"].update(default_exit_layer=1, default_gamma=3)
    stored.write_text(json.dumps(settings))
    moved = ["model.default_exit_layer=2", "model.default_gamma=5"]
    assert jobs.completed_summary(run_cfg("method=vanilla", "limit=1", *moved)) is not None
    runner.run(run_cfg("method=vanilla", "limit=2", *moved))  # continues the same run
    ls = run_cfg("method=ls", "limit=1", f"out_dir={cfg.out_dir}-ls")
    runner.run(ls)
    with pytest.raises(RunConflict, match="method"):  # the LS took the defaults: its E and γ moved with them
        runner.run(run_cfg("method=ls", "limit=1", f"out_dir={cfg.out_dir}-ls", *moved))


def test_prompts_task_reads_user_file(run_cfg, tmp_path):
    data = tmp_path / "mine.jsonl"
    data.write_text('{"id": "a", "prompt": "Hello"}\n{"id": "b", "prompt": "def f():"}\n')
    summary = runner.run(run_cfg("task=prompts", f"task.data_files={data}", "method=vanilla", "limit=null"))
    assert summary["n_samples"] == 2


def test_task_stop_strings_cut_generation(run_cfg):
    """Byte tokens make every character a token: each output (all three contain an "H" within 64
    tokens when unstopped) ends right at its first "H"."""
    summary = runner.run(run_cfg("method=ls", "method.exit_layer=1", "method.gamma=3", "limit=3",
                                 "max_new_tokens=64", "task.stop_strings=[H]"))
    for s in read_jsonl(RunDir(summary["config"]["out_dir"]).samples_path):
        assert s["output_text"].index("H") == len(s["output_text"]) - 1
        assert s["generated_tokens"] < 64


def test_wandb_offline_mirror_writes_a_local_run(run_cfg, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    cfg = run_cfg("method=ls", "method.exit_layer=1", "method.gamma=2", "limit=1", "logger=wandb",
                  "logger.mode=offline")
    runner.run(cfg)
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].rglob("*.wandb"))


def test_a_broken_tracker_never_fails_the_run(run_cfg, monkeypatch):
    calls = []

    def broken(*_):
        calls.append(1)
        raise RuntimeError("the tracker broke")

    monkeypatch.setattr(tracking, "_mirror", broken)
    summary = runner.run(run_cfg("method=vanilla", "limit=1", "logger=wandb", "logger.mode=disabled"))
    assert summary["n_samples"] == 1 and calls == [1]


@pytest.mark.parametrize("method", [
    ("method=swift", "method.context_window=4", "method.bayes_interval=3"),  # scope run: the search persists
    ("method=dv", "method.exit_layer=2", "method.reset_per_prompt=false"),  # the authors' θ across prompts
], ids=["swift-search", "dv-no-reset"])
def test_state_carried_across_prompts_survives_a_resume_and_the_warm_up(run_cfg, tmp_path, monkeypatch, method):
    """A run killed after its first prompt and resumed decodes every round exactly as an uninterrupted one, and an
    untimed warm-up leaves no trace: the method's cross-prompt state is saved with the run (method_state.json)
    and the warm-up decodes with a copy of the method."""
    over = (*method, "max_new_tokens=40")
    runner.run(run_cfg(*over, f"out_dir={tmp_path / 'whole'}"))
    resumed = run_cfg(*over, "warmup_tokens=40", f"out_dir={tmp_path / 'resumed'}")
    killed_on_call(3, resumed, monkeypatch)  # call 1 is the warm-up, call 2 the first prompt
    assert json.loads((tmp_path / "resumed" / "method_state.json").read_text())["samples"] == 1
    runner.run(resumed)

    def decisions(name):
        return [{k: v for k, v in r.items() if not k.endswith("_s")} for r in RunDir(tmp_path / name).rounds()]

    assert decisions("resumed") == decisions("whole")

    def state(name):
        return json.loads((tmp_path / name / "method_state.json").read_text())

    assert state("resumed") == state("whole") and state("whole")["samples"] == 3
    if method[0] == "method=swift":  # the search went on past the first prompt, continuing its step count
        searched = [r for r in decisions("whole") if "opt_step" in r]
        assert [r["opt_step"] for r in searched] == list(range(1, len(searched) + 1))
        assert len({r["sample_id"] for r in searched}) > 1


def test_the_cards_task_cnndm_is_the_papers_cnndm_summarisation():
    """`task=cnndm` (the model cards' command) composes, without loading weights, as cnndm_sum — the paper's default
    CNN/DM (1-shot summarisation) — with its offline data paths; sweeps resolve too; typos still get a suggestion."""
    cfg = compose_run(*resolve_aliases(["method=del", "model=llama2-7b", "task=cnndm"]))
    assert cfg.task.name == "cnndm_sum" and "/cnndm_sum/" in cfg.out_dir
    validate(cfg)
    local = compose_run(*resolve_aliases(["task=cnndm", "data=local"]))
    assert local.task.shots_files.endswith("cnn_dailymail/test_specbench80.jsonl")
    assert resolve_aliases(["task=cnndm,xsum", "+task=cnndm", "task.n=3", "model=cnndm"]) == [
        "task=cnndm_sum,xsum", "+task=cnndm_sum", "task.n=3", "model=cnndm"]
    check_overrides(["task=cnndm"])
    with pytest.raises(ConfigError, match="Did you mean 'cnndm'"):
        check_overrides(["task=cnndn"])


def test_the_cli_records_an_aliased_task_under_its_canonical_name(tmp_path, capsys):
    """The CLI resolves `task=cnndm` before Hydra: the run's config, run_key and out_dir name cnndm_sum; the table
    it prints (show's) names the task and the layer loop that ran."""
    data = tmp_path / "cnndm.jsonl"
    data.write_text("".join(json.dumps({"id": f"a{i}", "article": f"Article {i}.", "highlights": f"Summary {i}."})
                            + "\n" for i in range(3)))
    argv = ["model=tiny-random", "task=cnndm", "method=vanilla", f"task.data_files={data}", f"task.shots_files={data}",
            "limit=1", "max_new_tokens=4", "warmup_tokens=0", "threads=1", "layers=eager",
            f"records_root={tmp_path / 'runs'}"]
    assert cmd_run(argv) == 0
    (path,) = (tmp_path / "runs").glob("tiny-random/*/vanilla/*/summary.json")
    summary = json.loads(path.read_text())
    assert path.parts[-4] == summary["run_key"]["task"] == summary["config"]["task"]["name"] == "cnndm_sum"
    assert all(r["layer_path"] == "eager" for r in read_jsonl(path.parent / "samples.jsonl"))
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("tiny-random"))
    assert row.split()[1:3] == ["cnndm_sum", "Vanilla"] and " eager " in row  # show labels methods as the tables do


# ---- the untimed warm-up reaches steady state for the run's real shapes (issue 36)

def spied_generate(monkeypatch) -> list[dict]:
    """The generations decoded from now on, as they end (Engine.begin … Engine.finish): the prompt's length,
    max_new_tokens, seed, tokens out, whether EOS was on, and the global RNG's state the generation met."""
    real_begin, real_finish, calls, begun = Engine.begin, Engine.finish, [], {}

    def begin(self, request, t0):
        rng = torch.get_rng_state()
        run = real_begin(self, request, t0)
        begun[id(run)] = {"prompt": len(request.prompt_ids), "max_new": request.max_new_tokens, "seed": request.seed,
                          "eos": bool(self.eos_ids), "rng": rng}
        return run

    def finish(self, run):
        gen = real_finish(self, run)
        calls.append({**begun.pop(id(run)), "out": len(gen.output_ids)})
        return gen

    monkeypatch.setattr(Engine, "begin", begin)
    monkeypatch.setattr(Engine, "finish", finish)
    return calls


STEADY = ("warmup=steady", "warmup_tokens=16", "warmup_passes=3")


def test_a_steady_warm_up_covers_every_length_the_run_reaches_and_is_recorded(run_cfg, tmp_path, monkeypatch):
    calls = spied_generate(monkeypatch)
    summary = runner.run(run_cfg("method=ls", "method.exit_layer=2", "method.gamma=2", "limit=3", "max_new_tokens=8",
                                 *STEADY))
    lengths = [len(s["prompt_ids"]) for s in read_jsonl(tmp_path / "run" / "samples.jsonl")]
    reach = max(lengths) + 8
    (line,) = summary["setup"]
    warmup = line["warmup"]
    assert warmup["mode"] == "steady" and warmup["prompt_tokens"] == [min(lengths), max(lengths)]
    assert warmup["cache_length"] == reach and warmup["tolerance"] == 0.1
    passes = warmup["ms_per_token"]
    assert 2 <= len(passes) <= 3 and warmup["converged"] == runner.converged(passes, 0.1)
    assert len(passes) == 3 or warmup["converged"]  # it stops at two passes only when they agree
    untimed = [c for c in calls if c["seed"] == 0]
    assert calls[:len(untimed)] == untimed and len(untimed) == 2 * len(passes)  # all before the first timed sample
    for prefill, decode in zip(untimed[::2], untimed[1::2]):
        assert (prefill["prompt"], prefill["max_new"]) == (max(lengths), 1)  # the longest prompt's prefill
        # the shortest prompt decoded, EOS off, to the longest sequence the run reaches
        assert (decode["prompt"], decode["prompt"] + decode["out"], decode["eos"]) == (min(lengths), reach, False)
    assert all(c["eos"] for c in calls[len(untimed):])  # the timed samples stop at EOS as always
    assert summary["steady_state"]["warmups_unconverged"] == (not warmup["converged"])


def test_a_warm_up_leaves_no_trace_in_the_methods_state_or_the_global_rng(run_cfg, tmp_path, monkeypatch):
    """DV without reset carries θ across prompts; the warm-up's passes decode with copies of it, and under a forked
    RNG: a method drawing from torch's global RNG (as transformers' sampling does) meets, at the first timed sample,
    the state it would without a warm-up."""
    over = ("method=dv", "method.exit_layer=2", "method.reset_per_prompt=false", "max_new_tokens=12",
            "method._target_=tests.test_runner.GlobalRngDV")

    def decode(name, *warmup):
        calls = spied_generate(monkeypatch)
        torch.manual_seed(7)
        runner.run(run_cfg(*over, *warmup, f"out_dir={tmp_path / name}"))
        rounds = [{k: v for k, v in r.items() if not k.endswith("_s")} for r in RunDir(tmp_path / name).rounds()]
        state = json.loads((tmp_path / name / "method_state.json").read_text())
        return rounds, state, next(c["rng"] for c in calls if c["seed"] != 0)

    cold, warm = decode("cold", "warmup=off"), decode("warm", *STEADY)
    assert cold[0] == warm[0] and cold[1] == warm[1]  # every decision, and the state carried after the last prompt
    assert torch.equal(cold[2], warm[2])  # the global RNG the first timed sample met
    assert RunDir(tmp_path / "warm").setup()[0]["warmup"]["mode"] == "steady"


class GlobalRngDV(DraftVerify):
    """DV that draws from torch's global RNG at every prompt (what a warm-up must not shift)."""

    def start(self, num_layers: int) -> None:
        super().start(num_layers)
        torch.rand(1)


def test_a_multi_turn_sample_is_warmed_up_to_the_longest_conversation_it_can_reach():
    from del_bench.tasks.base import Sample

    class Turns:  # a conversation rendered as its text; each answer in the history follows its user turn
        def render(self, sample, history):
            return sample.prompt + "".join(f"|{u}|{a}" for u, a in history) + f"|{sample.turns[len(history)]}"

    def tokenizer(text):
        return {"input_ids": list(text.encode())}

    samples = [Sample("a", "xy"), Sample("b", "p", turns=["one", "three"])]
    shortest, longest, reach = runner.warmup_prompts(Turns(), tokenizer, samples, 10)
    assert bytes(shortest) == b"xy" and bytes(longest) == b"p|one"  # first turns: what the timed prefills start at
    assert reach == len("p|one||three") + 2 * 10  # the last turn with empty answers + max_new_tokens a turn


def test_the_steady_warm_up_decodes_past_eos_and_stop_strings(tiny):
    from del_bench.engine.sampling import Sampling
    from del_bench.methods.vanilla import Vanilla

    model, _ = tiny
    engine = Engine(stack_of(model, layers="eager"), Sampling(), set(range(model.config.vocab_size)),
                    stop=lambda ids: True)  # every token ends a generation
    assert len(engine.generate([1, 2, 3], Vanilla(), 6, 0).output_ids) == 1
    with runner.decoding_past_stops([engine]):
        assert len(engine.generate([1, 2, 3], Vanilla(), 6, 0).output_ids) == 6
    assert engine.eos_ids and engine.stop is not None  # back as they were


def test_a_warm_up_that_runs_out_of_passes_flags_the_run(run_cfg):
    summary = runner.run(run_cfg("method=vanilla", "limit=2", "max_new_tokens=4", "warmup=steady", "warmup_tokens=1",
                                 "warmup_passes=2", "warmup_tolerance=1e-12"))  # two passes never agree that closely
    warmup = summary["setup"][0]["warmup"]
    assert len(warmup["ms_per_token"]) == 2 and warmup["converged"] is False
    assert summary["steady_state"] == {"first_slowdown": summary["steady_state"]["first_slowdown"],
                                       "lead_slowdown": summary["steady_state"]["lead_slowdown"],
                                       "warmups_unconverged": 1, "steady": False}


def test_a_later_session_within_a_converged_warm_up_is_at_steady_state_already(run_cfg, tmp_path, monkeypatch):
    """As a bench grows its runs a prompt at a time: a session of the same method on the same loaded model whose
    lengths lie within a steady warm-up that converged in this process decodes no more passes."""
    first = run_cfg("method=vanilla", "limit=3", "max_new_tokens=6", *STEADY[:2], "warmup_passes=5",
                    "warmup_tolerance=0.99")
    load = harness_load(first)
    summary = runner.run(first, load)
    assert summary["setup"][0]["warmup"]["converged"]
    calls = spied_generate(monkeypatch)
    again = runner.run(run_cfg("method=vanilla", "limit=1", "max_new_tokens=6", *STEADY[:2],
                               f"out_dir={tmp_path / 'again'}"), load)
    warmup = again["setup"][0]["warmup"]
    assert warmup["ms_per_token"] == [] and warmup["converged"] and "earlier session" in warmup["covered"]
    assert [c["seed"] for c in calls] != [0] and all(c["seed"] != 0 for c in calls)  # the timed sample alone
    high = summary["setup"][0]["warmup"]["cache_length"]
    longer = runner.run(run_cfg("method=vanilla", "limit=1", f"max_new_tokens={high}", *STEADY[:2],
                                f"out_dir={tmp_path / 'longer'}"), load)
    assert longer["setup"][0]["warmup"]["ms_per_token"]  # beyond the covered lengths: warmed up again


def harness_load(cfg):
    from del_bench.bench.harness import shared_load

    return shared_load(cfg)


def test_the_warm_up_is_steady_on_cuda_quick_elsewhere_and_checked():
    cfg = compose_run()
    assert (runner.warmup_mode(cfg, "cuda:0"), runner.warmup_mode(cfg, "cpu")) == ("steady", "quick")
    assert runner.warmup_mode(compose_run("warmup=steady"), "cpu") == "steady"
    assert runner.warmup_mode(compose_run("warmup=off"), "cuda:0") == "off"  # YAML's off is false
    assert runner.warmup_mode(compose_run("warmup_tokens=0"), "cuda:0") == "off"  # as before: no warm-up at all
    for bad, message in (("warmup=stedy", "Did you mean 'steady'"), ("warmup_passes=1", "warmup_passes=1: must be"),
                         ("warmup_tolerance=1.5", "warmup_tolerance=1.5: must be")):
        with pytest.raises(ConfigError, match=message):
            validate(compose_run(bad))


def test_a_quick_warm_up_is_recorded(run_cfg):
    summary = runner.run(run_cfg("method=vanilla", "limit=1", "max_new_tokens=4", "warmup_tokens=3"))
    warmup = summary["setup"][0]["warmup"]
    assert warmup["mode"] == "quick" and len(warmup["ms_per_token"]) == 1 and warmup["converged"] is None
    assert 1 <= warmup["tokens"] <= 3


# ---- costs.json: measured on the device at hand, never reused from another

def test_costs_are_reused_only_on_the_device_they_were_measured_on(run_cfg, tmp_path, caplog):
    over = ("method=del_cpu", "max_new_tokens=4")
    runner.run(run_cfg(*over, "limit=1"))
    run_dir = RunDir(tmp_path / "run")
    here = run_dir.costs()["device"]
    assert here.startswith("cpu ") and "(1 threads), float64, " in here and here.endswith(" layers")
    runner.run(run_cfg(*over, "limit=2"))  # a resume here reuses them
    costs = run_dir.costs()
    costs["device"] = "NVIDIA H100 80GB HBM3, bfloat16, fused layers"
    run_dir.write_costs(costs)
    summary = runner.run(run_cfg(*over, "limit=3"))  # a resume elsewhere measures again
    assert [(s["costs_device"], s["costs_measured"]) for s in summary["setup"]] == [(here, True), (here, False),
                                                                                   (here, True)]
    assert run_dir.costs()["device"] == here and summary["measured_costs"]["device"] == here
    assert "costs.json was measured on NVIDIA H100 80GB HBM3" in caplog.text
