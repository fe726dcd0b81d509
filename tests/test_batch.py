"""Batched decoding (batch_size = B > 1: del_bench/engine/batch.py, the round driver of every batch size) is lossless
per row: at B = 4, with prompts of different lengths and answers of
different lengths (budgets, an EOS), every method's rows each decode exactly what that prompt decodes alone — greedy
tokens equal to its batch-1 output and to `generate`'s, sampled tokens equal to its batch-1 output under the same seed
(float64), its rounds (plans, drafts, confidences, acceptance, loads, head rows, host reads) the same — and in half
precision equal or first departing at a near-tie of the batch-1 run's logits. A row that leaks its positions, cache or
logits into a neighbour, or idles over its own positions, fails these checks (the mutants below); the same batch
decoded twice gives the same records; and the batch's loads are counted where they run."""

from __future__ import annotations

import copy
import dataclasses
import json
import math

import pytest
import torch

from del_bench import runner, session
from del_bench.__main__ import format_table
from del_bench.engine import static_steps
from del_bench.engine.batch import Batch
from del_bench.engine.decode import Engine, Request
from del_bench.engine.sampling import Sampling
from del_bench.engine.static_steps import RowSkips, RowSteps, StepRows, live_sublayers, row_positions
from del_bench.errors import ConfigError
from del_bench.methods.peers import peer_method
from del_bench.models.layer_stack import LayerStack
from del_bench.numerics import compare
from del_bench.records import RunDir, RunKey, batch_etpl, read_jsonl, throughput
from del_bench.report.collect import load_runs
from del_bench.report.figures import build_figures
from del_bench.report.tables import build_tables
from tests.conftest import compose_run, tiny_model
from tests.test_counted import VARIANTS, method_of
from tests.test_engine import hf_greedy
from tests.test_specbench import write_questions

B = 4
# six prompts of different lengths for four slots (two slots take a second prompt as their first ends); budgets of
# different lengths, and an EOS some answers reach (EOS_FROM: the token prompt 1's greedy answer emits 4th)
PROMPTS = ["def add(a, b):\n", "The quick brown fox jumps over", "x", "import os\nimport sys\n\nprint(",
           "def fibonacci(n):\n    if n < 2:\n        return n\n    return fib", "1, 2, 3,"]
BUDGETS = [14, 9, 18, 6, 12, 16]
# the first four jobs fit in the shared cache; the fifth (a prompt longer than DEL's prefill window of 32, which a
# slot takes mid-run) does not: the cache grows while the other rows hold their positions
CACHE_LEN = 48
CASES = {  # every method, in the configurations tests/test_counted.py drives on this 4-layer model
    "vanilla": [], "ls": ["method.exit_layer=1", "method.gamma=3"], "fs": [], "dv": [], "del": [],
    "del_cpu": [],  # DEL as on a CPU: measured costs, restricted shadow vocabulary, deferred scoring
    "swift-search": dict(VARIANTS["swift"])["search"], "swift-tree": dict(VARIANTS["swift"])["tree"],
    "clasp": VARIANTS["clasp"][0][1], "knapspec": VARIANTS["knapspec"][0][1],
    "adadecode": dict(VARIANTS["adadecode"])["eager-exits"],
}
GREEDY = Sampling()
SAMPLING = Sampling(do_sample=True, temperature=1.2, top_p=0.95)


def method(case: str):
    return method_of(case.split("-")[0], CASES[case])


@pytest.fixture(scope="module")
def setup():
    """(stack, prompt ids, EOS ids, generate's greedy answers): the float64 tiny model, its references taken before
    LayerStack lays its weights out."""
    model, tok = tiny_model()
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    eos = {hf_greedy(model, prompts[1], 4)[3]}
    refs = [hf_greedy(model, p, n, eos=list(eos)) for p, n in zip(prompts, BUDGETS)]
    return LayerStack(model), prompts, eos, refs


def alone(stack, prompts, eos, m, sampling=GREEDY):
    """Each prompt decoded by itself (batch 1), a fresh copy of the method each."""
    engine = Engine(stack, sampling, eos)
    return [engine.generate(p, copy.deepcopy(m), n, seed=i) for i, (p, n) in enumerate(zip(prompts, BUDGETS))]


def batch_of(stack, m, sampling=GREEDY, eos=frozenset(), size=B):
    """The batch a run would decode with."""
    return Batch(stack, size, sampling, set(eos), cache_len=CACHE_LEN)


def batched(stack, prompts, eos, m, sampling=GREEDY, budgets=BUDGETS):
    """The prompts decoded by a batch of B slots → (each prompt's Generation, the batch's counts, its rows'
    (slot, share of loaded layers) per prompt)."""
    batch = batch_of(stack, m, sampling, eos)
    out, shares = {}, {}

    def decode(row, i):  # a job: it yields its request, and is sent its generation
        out[i] = yield Request(prompts[i], copy.deepcopy(m), budgets[i], seed=i)
        shares[i] = (row.slot, row.loaded_layers)

    stats = batch.run(range(len(prompts)), decode)
    return [out[i] for i in range(len(prompts))], stats, [shares[i] for i in range(len(prompts))]


def rounds_of(gen, syncs: bool = True) -> list[dict]:
    """A generation's rounds without their timings (what must be the same alone and in a batch); syncs: with their
    host transfers."""
    return [{k: v for k, v in r.as_dict().items() if not k.endswith("_s") and (syncs or k != "host_syncs")}
            for r in gen.rounds]


def close(a, b) -> bool:
    """Equal, floats to 1e-9 relative (a row's products share a GEMM with its neighbours': float64 rounding)."""
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(close(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(close(x, y) for x, y in zip(a, b))
    return a == b


# ---- lossless per row --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES)
def test_every_row_greedy_is_its_batch1_output_and_generates(setup, case):
    stack, prompts, eos, refs = setup
    m = method(case)
    single = alone(stack, prompts, eos, m)
    gens, stats, shares = batched(stack, prompts, eos, m)
    for i, (one, gen) in enumerate(zip(single, gens)):
        assert gen.output_ids == one.output_ids == refs[i], f"prompt {i}"
        assert close(rounds_of(gen), rounds_of(one)), f"prompt {i}: its rounds differ from batch 1's"
    assert any(r.drafted for g in gens for r in g.rounds) or case == "vanilla"  # drafts happened (not vacuous)
    assert {slot for slot, _ in shares} == set(range(B))  # every slot decoded, two of them a second prompt
    # the batch loads each (sub)layer once for all its rows: fewer than the rows alone, the rows' shares its total
    assert math.isclose(sum(share for _, share in shares), stats["loaded_layers"])
    assert stats["loaded_layers"] < sum(g.loaded_layers for g in gens)


@pytest.mark.parametrize("case", ["vanilla", "ls", "del", "swift-tree", "clasp", "knapspec", "adadecode"])
def test_every_row_sampled_is_its_batch1_output_with_its_seed(setup, case):
    """Each row draws from its own RNG stream (seeded per prompt) on its own logits: its neighbours change nothing."""
    stack, prompts, eos, _ = setup
    m = method(case)
    single = alone(stack, prompts, eos, m, SAMPLING)
    gens, _, _ = batched(stack, prompts, eos, m, SAMPLING)
    assert [g.output_ids for g in gens] == [g.output_ids for g in single]
    assert len({tuple(g.output_ids) for g in gens}) == len(gens)


@pytest.mark.parametrize("case", ["vanilla", "ls", "del", "swift-tree", "adadecode"])
def test_half_precision_rows_follow_the_near_tie_rule_against_batch1(case):
    """bfloat16: a row's products share a GEMM with its neighbours' rows, so it may round otherwise than alone; its
    output equals its batch-1 output or first departs at a near-tie of the batch-1 run's own logits."""
    model, tok = tiny_model(torch.bfloat16)
    stack = LayerStack(model)
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    m = method(case)
    single = alone(stack, prompts, set(), m)
    gens, _, _ = batched(stack, prompts, set(), m)
    for one, gen in zip(single, gens):
        assert compare(gen.output_ids, one.output_ids, one.top2_gap_ulps).kind in ("equal", "near_tie")


# ---- mutants: a row that leaks into a neighbour fails the checks above ------------------------------------------
def _swap_first_two_rows_positions(original):
    def mutant(self, start, end, h, rows, *args, **kwargs):
        if rows.rows > 1:
            rows = dataclasses.replace(rows, first=[rows.first[1], rows.first[0], *rows.first[2:]],
                                       count=[rows.count[1], rows.count[0], *rows.count[2:]])
        return original(self, start, end, h, rows, *args, **kwargs)
    return mutant


def _one_cache_for_all(original):
    def mutant(self, r, view=None):
        return original(self, 0, view)  # every row's view is row 0's
    return mutant


def _rotated_logits(original):
    def mutant(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        return out[1:] + out[:1]
    return mutant


@pytest.mark.parametrize("leak", ["positions", "cache", "logits"])
def test_a_row_leaking_into_its_neighbour_fails_the_equality(setup, leak, monkeypatch):
    from del_bench.models.kv_cache import KVCache

    cls, name, factory = {"positions": (RowSteps, "run", _swap_first_two_rows_positions),
                          "cache": (KVCache, "row", _one_cache_for_all),
                          "logits": (Batch, "head", _rotated_logits)}[leak]
    stack, prompts, eos, refs = setup
    m = method("del")  # rows at their own exit layers, idling above them and once their drafts end
    single = alone(stack, prompts, eos, m)
    monkeypatch.setattr(cls, name, factory(getattr(cls, name)))
    try:
        gens, _, _ = batched(stack, prompts, eos, m)
    except RuntimeError:  # a leaked position may also break a row's cache lengths: caught either way
        return
    assert [rounds_of(g) for g in gens] != [rounds_of(g) for g in single]


def test_determinism_the_same_batched_run_twice_gives_the_same_records(run_cfg, tmp_path, monkeypatch):
    """Thread timing must not matter: every record — in file order, slots and the rows' shares of the batch's loads
    included — is the same in two runs of one batch, but for its times."""
    overrides = ("method=del_cpu", "limit=5", "max_new_tokens=12", "batch_size=3")
    monkeypatch.setattr(LayerStack, "cost_device", lambda self: "this device")  # the costs below were measured here
    runs = []
    for name in ("one", "two"):  # DEL-CPU decides on measured costs: both runs read the same (the clock's aside)
        (tmp_path / name).mkdir()
        RunDir(tmp_path / name).write_costs({"layer_s": 1.0, "head_s": 0.2, "batch_s": [[1, 4.0], [2, 4.4], [4, 5.2]],
                                             "device": "this device"})
        runner.run(run_cfg(*overrides, f"out_dir={tmp_path / name}"))
        samples, rounds = (read_jsonl(tmp_path / name / f) for f in ("samples.jsonl", "rounds.jsonl"))
        for r in samples:
            r["batch"] = {k: v for k, v in r["batch"].items() if not k.endswith("_s")}
        runs.append([untimed(r) for r in samples + rounds])
    assert runs[0] == runs[1]
    assert sorted({r["batch"]["slot"] for r in runs[0] if "batch" in r}) == [0, 1, 2]


def untimed(record: dict) -> dict:
    """A record without what a clock or the machine measured."""
    measured = {"wall_s", "tokens_per_s", "ttft_s", "peak_memory_bytes", "load", "draft_s", "verify_s", "policy_s"}
    return {k: v for k, v in record.items() if k not in measured}


# ---- the batch's accounting --------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["vanilla", "ls", "del", "swift-search", "clasp", "adadecode"])
def test_the_batch_loads_are_what_ran(setup, case):
    """The batch's loaded layers equal the layers, sublayers and selection passes the stack executed (its counter),
    each batched call of a (sub)layer counted once for all its rows."""
    stack, prompts, eos, _ = setup
    with stack.counting() as counter:
        gens, stats, _ = batched(stack, prompts, eos, method(case))
    assert counter.layers == stats["loaded_layers"]
    assert counter.head_rows == sum(g.head_calls for g in gens)  # head rows are per row, as alone


def test_vanilla_rows_in_lockstep_share_every_layer(setup):
    """Four equal rows: each round runs every layer for all four at once, so beyond their prefills (each row's own)
    the batch loads a quarter of what the rows claim, one head pass and one host read a round for the four."""
    stack, prompts, _, _ = setup
    L = stack.num_layers
    gens, stats, _ = batched(stack, [prompts[0]] * B, set(), method("vanilla"), budgets=[10] * B)
    assert (stats["loaded_layers"] - B * L) * B == sum(g.loaded_layers for g in gens) - B * L
    assert stats["head_passes"] * B == sum(g.head_calls for g in gens) - B  # the prefills' heads are each row's
    assert stats["idle_layers"] == 0 and stats["rounds"] == 9
    assert stats["reads"] == 9 + 2 * B  # one a round; a prefill's two each (its prompt up, its first token back)


def test_continuous_batching_refills_a_slot_as_its_row_ends(setup):
    """Vanilla emits one token a row per sweep: the row with the shortest answer ends first and its slot, not the
    first slot, takes the next prompt at once."""
    stack, prompts, eos, refs = setup
    _, _, shares = batched(stack, prompts, eos, method("vanilla"))
    slots = [slot for slot, _ in shares]
    assert slots[:B] == list(range(B))  # the first four prompts start in slot order
    first_to_end = min(range(B), key=lambda i: len(refs[i]))
    assert first_to_end != 0 and slots[B] == first_to_end


# ---- the run: config, records, resume ----------------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["0", "-2", "1.5", "two", "true"])
def test_batch_size_must_be_a_positive_integer_before_any_weights_load(run_cfg, bad, monkeypatch):
    monkeypatch.setattr(session, "load_model", lambda *a: pytest.fail("a model was loaded"))
    with pytest.raises(ConfigError, match="batch_size"):
        runner.run(run_cfg("method=vanilla", f"batch_size={bad}"))


def test_a_batched_run_refuses_what_decodes_one_prompt_at_a_time(run_cfg):
    cfg = run_cfg("method=vanilla", "batch_size=2")
    cfg.method = peer_method("hf_forward_loop")  # a peer row (del_bench/methods/peers.py): transformers decodes
    with pytest.raises(ConfigError, match="one prompt at a time"):
        runner.run(cfg)
    with pytest.raises(ConfigError, match="cannot run on graphs"):  # SWIFT's tree: no graphs for its batch, refused
        runner.run(run_cfg("method=swift", "method.tree=true", "batch_size=2", "compile=on", "limit=2"))  # unloaded


def test_generate_runs_batched_as_a_peer_row(run_cfg, tmp_path):
    """transformers' batched generate as the peer row at B = 3 (methods/peers.PeerBatch): one call over up to three
    left-padded prompts of different lengths, each output that of generate on its prompt alone (float64: the padding
    moves no argmax), recorded as a batch's rows (slots, shares of the call's layer calls, the padding's idle calls),
    and no host reads of ours claimed for it."""
    def run(B):
        cfg = run_cfg("method=vanilla", "limit=5", "max_new_tokens=12", f"batch_size={B}",
                      f"out_dir={tmp_path / f'b{B}'}")
        cfg.method = peer_method("hf_generate")
        return runner.run(cfg), read_jsonl(RunDir(str(tmp_path / f"b{B}")).samples_path)

    (one, alone), (three, batched) = run(1), run(3)
    alone = {s["sample_id"]: s for s in alone}
    assert len({len(alone[s]["prompt_ids"]) for s in alone}) > 1  # the prompts pad to the longest
    assert sorted(s["sample_id"] for s in batched) == sorted(alone)
    for s in batched:
        assert s["output_ids"] == alone[s["sample_id"]]["output_ids"]
        assert s["batch"]["loaded_layers"] < s["loaded_layers"] and s["batch"]["idle_layers"] >= 0
    assert sorted({s["batch"]["slot"] for s in batched}) == [0, 1, 2]
    calls = {s["loaded_layers"] for s in batched}  # each call's layer calls (12 tokens each: the same for both)
    assert len(calls) == 1  # 5 prompts: a call of 3, then one of 2, the rows' shares adding up to both calls'
    assert sum(s["batch"]["loaded_layers"] for s in batched) == pytest.approx(2 * calls.pop())
    assert three["batch_etpl"] > one["batch_etpl"]
    assert three["host_reads_per_round"] is None and three["throughput"] == throughput(batched)


def test_a_batched_run_records_its_batch(tmp_path):
    """out_dir, run key, per-row latency and time to first token, slots and shares; the summary's throughput and
    batch eTPL recomputed from the records; greedy outputs those of the same run at batch size 1."""
    def run(*extra):  # run.yaml's own out_dir, under tmp_path
        return runner.run(compose_run("model=tiny-random", "limit=5", "max_new_tokens=16", "warmup_tokens=0",
                                      "threads=1", "products=wt_x", f"records_root={tmp_path}", *extra))

    ls = ("method=ls", "method.exit_layer=1", "method.gamma=3")
    one, four = run(*ls), run(*ls, "batch_size=4")
    assert four["config"]["out_dir"] == one["config"]["out_dir"] + "-b4"
    key1, key4 = RunKey.from_dict(one["run_key"]), RunKey.from_dict(four["run_key"])
    assert (key1.batch_size, key4.batch_size, four["batch_size"]) == (1, 4, 4)
    assert key4.pair_id() != key1.pair_id() and key4.label() == key1.label() + " B=4"
    samples = read_jsonl(RunDir(four["config"]["out_dir"]).samples_path)
    alone_samples = {s["sample_id"]: s for s in read_jsonl(RunDir(one["config"]["out_dir"]).samples_path)}
    for s in samples:
        assert s["output_ids"] == alone_samples[s["sample_id"]]["output_ids"]
        assert 0 < s["ttft_s"] <= s["wall_s"] and s["batch"]["start_s"] < s["batch"]["end_s"]
        assert s["batch"]["loaded_layers"] < s["loaded_layers"]  # its share of layers it ran beside other rows
    assert sorted({s["batch"]["slot"] for s in samples}) == [0, 1, 2, 3]
    assert four["throughput"] == throughput(samples) == pytest.approx(
        four["generated_tokens"] / max(s["batch"]["end_s"] for s in samples))
    assert four["batch_etpl"] == batch_etpl(samples) > four["etpl"]  # the rows' shared loads
    assert one["batch_etpl"] == pytest.approx(one["generated_tokens"] / one["loaded_layers"])

    # show and the report: the batched rows labelled, the figure of speedup against the batch size drawn
    vanilla = [run("method=vanilla", f"batch_size={b}") for b in (1, 4)]
    shown = format_table([one, four, *vanilla])
    assert "LS(E1-γ3) B=4" in shown and "Vanilla B=4" in shown and "4 prompts decoded together" in shown
    df = load_runs([tmp_path])
    assert sorted(zip(df.method, df.batch_size)) == [("ls", 1), ("ls", 4), ("vanilla", 1), ("vanilla", 4)]
    assert list(df[df.method == "vanilla"].throughput_speedup) == [1.0, 1.0]  # each over Vanilla at its own B
    figures = build_figures(df)
    batch = [name for name in figures if name.startswith("batch_")]
    assert len(batch) == 1 and [len(line.get_xdata()) for line in figures[batch[0]].axes[1].lines[:2]] == [2, 2]
    table2 = build_tables(df)[1]  # HumanEval's: each batch size its own row, labelled
    ours = sorted(r.label.removesuffix(" ‡") for r in table2.rows if r.source.startswith("ours"))  # ‡: busy
    assert ours == ["LS(E1-γ3)", "LS(E1-γ3) B=4", "Vanilla", "Vanilla B=4"]


def test_an_interrupted_batched_run_resumes_without_losing_or_repeating_a_sample(run_cfg, tmp_path, monkeypatch):
    """The run stops (an error in a row's job) right after the 3rd sample's rounds are written, before its sample
    line: the rerun decodes exactly the samples not finished, and the records are those of an uninterrupted run."""
    overrides = ("method=dv", "method.exit_layer=2", "limit=6", "max_new_tokens=10", "batch_size=3")
    runner.run(run_cfg(*overrides, f"out_dir={tmp_path / 'whole'}"))
    append, calls = RunDir.append, []

    def append_then_stop(self, sample, rounds):
        calls.append(sample["sample_id"])
        if len(calls) == 3:
            with open(self.rounds_path, "a") as f:  # its rounds, not its sample line
                f.write("".join(json.dumps(r) + "\n" for r in rounds))
            raise KeyboardInterrupt
        append(self, sample, rounds)

    with monkeypatch.context() as patch:
        patch.setattr(RunDir, "append", append_then_stop)
        with pytest.raises(KeyboardInterrupt):
            runner.run(run_cfg(*overrides, f"out_dir={tmp_path / 'cut'}"))
    assert len(read_jsonl(tmp_path / "cut" / "samples.jsonl")) == 2
    runner.run(run_cfg(*overrides, f"out_dir={tmp_path / 'cut'}"))
    whole, cut = ({s["sample_id"]: s for s in read_jsonl(tmp_path / d / "samples.jsonl")} for d in ("whole", "cut"))
    assert len(read_jsonl(tmp_path / "cut" / "samples.jsonl")) == 6 and whole.keys() == cut.keys()
    assert all(cut[i]["output_ids"] == whole[i]["output_ids"] for i in whole)
    rounds = read_jsonl(tmp_path / "cut" / "rounds.jsonl")
    for i, s in cut.items():  # no sample's rounds twice
        assert sum(r["emitted"] for r in rounds if r["sample_id"] == i) == s["generated_tokens"]
    assert {s["batch"]["session"] for s in cut.values()} == {0, 1}  # two sessions, each its own span


def test_multi_turn_samples_decode_turn_by_turn_in_a_batch(run_cfg, tmp_path):
    """Spec-Bench's two-turn questions at batch size 2: each turn a generation in the row's slot (the second over
    a longer prompt: the shared cache grows), the outputs those of batch size 1."""
    questions = write_questions(tmp_path / "question.jsonl")

    def specbench(batch_size):
        out = tmp_path / f"b{batch_size}"
        runner.run(run_cfg("task=specbench", f"task.data_files={questions}", "method=ls", "method.exit_layer=1",
                           "method.gamma=2", "limit=null", "max_new_tokens=6", f"out_dir={out}",
                           f"batch_size={batch_size}"))
        return {s["sample_id"]: s for s in read_jsonl(out / "samples.jsonl")}

    one, two = specbench(1), specbench(2)
    assert any(len(s["turns"]) == 2 for s in two.values())
    assert {i: s["output_ids"] for i, s in two.items()} == {i: s["output_ids"] for i, s in one.items()}


def test_records_from_before_batch_size_read_as_batch_1(run_cfg, tmp_path):
    """An older run_config.json (no batch_size) still resumes at batch size 1; an older run key pairs as batch 1."""
    cfg = run_cfg("method=vanilla", "limit=1")
    summary = runner.run(cfg)
    path = RunDir(cfg.out_dir).config_path
    assert "batch_size" not in json.loads(path.read_text())  # batch size 1 is left out: as before it existed
    runner.run(run_cfg("method=vanilla", "limit=2"))
    old = {k: v for k, v in summary["run_key"].items() if k != "batch_size"}
    assert RunKey.from_dict(old) == RunKey.from_dict(summary["run_key"])
    assert RunKey.from_dict(old).pairs_with(RunKey.from_dict(summary["run_key"]))


def test_an_error_in_a_row_stops_the_batch_and_reaches_the_caller(setup):
    """A row whose job raises (mid-batch, its neighbours mid-generation): the batch closes every job and raises that
    error where it was run; the batch then decodes again."""
    stack, prompts, eos, refs = setup
    batch = Batch(stack, B, GREEDY, eos, cache_len=CACHE_LEN)
    vanilla = method("vanilla")
    closed = []

    def decode(row, i):
        try:
            yield Request(prompts[i], copy.deepcopy(vanilla), BUDGETS[i], seed=i)
        except GeneratorExit:
            closed.append(i)
            raise
        if i == 2:
            raise ValueError("row 2 failed")

    with pytest.raises(ValueError, match="row 2 failed"):
        batch.run(range(len(prompts)), decode)
    assert closed  # the neighbours' jobs closed, their contexts exited
    out = {}

    def again(row, i):
        out[i] = (yield Request(prompts[i], copy.deepcopy(vanilla), BUDGETS[i], seed=i)).output_ids

    batch.run(range(2), again)
    assert [out[0], out[1]] == refs[:2]


def test_once_the_jobs_run_out_the_running_rows_move_down_and_steps_run_them_alone(setup, monkeypatch):
    """Continuous batching's tail: a slot that empties with no job left is filled by the highest running row (its
    cache row copied, its view re-pointed), so the running rows are always the first ones and each step on a CPU runs
    over them alone — its rows' tokens and rounds unchanged, and no idle work beyond what the running rows idle; the
    last row, alone, runs on the stack's own loop (no static step at all)."""
    stack, prompts, eos, refs = setup
    widths, run = [], RowSteps.run

    def spy(self, start, end, h, rows, *args, **kwargs):
        widths.append(h.shape[0])
        return run(self, start, end, h, rows, *args, **kwargs)

    monkeypatch.setattr(RowSteps, "run", spy)
    gens, stats, _ = batched(stack, prompts, eos, method("vanilla"))
    assert [g.output_ids for g in gens] == refs
    assert widths[0] == B and widths[-1] == 2 and sorted(widths, reverse=True) == widths  # the tail shrinks
    assert stats["idle_layers"] == 0  # Vanilla's running rows all run every layer: nothing idles


def test_one_host_read_a_round_for_the_whole_batch_counted_independently(setup):
    """The batch's host reads, counted by the independent counter (bench/syncs.py: every tensor read and transfer)
    around a Vanilla batch of four rows: one a round for all of them, two a prefill (the prompt up, its first token
    back) — what the batch's own count and its rows' shares (records.host_reads) say."""
    from del_bench.bench.syncs import count_syncs

    stack, prompts, eos, _ = setup
    batch = batch_of(stack, method("vanilla"), GREEDY, eos)
    shares = []

    def decode(row, i):
        yield Request(prompts[i], copy.deepcopy(method("vanilla")), BUDGETS[i], seed=i)
        shares.append(row.tally())

    with count_syncs() as counted:
        stats = batch.run(range(len(prompts)), decode)
    assert counted.total == stats["reads"] == stats["rounds"] + 2 * len(prompts)
    assert math.isclose(sum(r for r, _ in shares), stats["reads"])
    assert math.isclose(sum(n for _, n in shares), stats["rounds"] + len(prompts))


# ---- what a step uploads: each row's first position, width and layers; the masks made on the device ----------------
def test_the_device_masks_are_what_the_host_decided():
    """From a step's 4B uploaded ints (and a skipping round's skip sets) the device makes each row's positions and
    which rows run each sublayer; they are exactly what the host counts from the same StepRows (its loads, which
    sublayers it computes): random rows, spans, widths and skip sets, with and without skips, for chains that begin
    and end anywhere."""
    gen = torch.Generator().manual_seed(0)
    L, B, W = 6, 5, 4
    for trial in range(40):
        def ints(low, high):
            return torch.randint(low, high, (B,), generator=gen).tolist()
        lo, span, count = ints(0, L), ints(0, L + 1), ints(0, W + 1)
        skips = None
        if trial % 2:
            sets = [(frozenset(i for i in range(L) if torch.rand(1, generator=gen) < 0.3),
                     frozenset(i for i in range(L) if torch.rand(1, generator=gen) < 0.3)) for _ in range(B)]
            skips = RowSkips.of(sets, B, L, torch.device("cpu"))
        rows = StepRows(ints(0, 50), count, lo, [min(L, a + d) for a, d in zip(lo, span)], held=60, skips=skips)
        start, end = sorted(torch.randint(0, L + 1, (2,), generator=gen).tolist())
        if start == end:
            continue
        first, n, low, high = static_steps.upload(rows.values(), torch.device("cpu")).view(4, B)
        live = live_sublayers(low, high, None if skips is None else skips.keep, start, end)  # [2n, B]
        for b in range(B):
            assert live[:, b].nonzero().flatten().tolist() == list(rows.sublayers_of(b, start, end))
        assert live.sum(1).tolist() == rows.users(start, end)
        at = row_positions(first, n, W, 63)
        for b in range(B):
            assert at[b].tolist() == [rows.first[b] + t if t < rows.count[b] else 63 for t in range(W)]


@pytest.mark.parametrize("case", ["del", "clasp"])
def test_a_step_uploads_4_ints_a_row_and_a_skipping_round_its_skip_sets_once(setup, case, monkeypatch):
    """What the host sends the device for a batch's steps: one upload of each row's first position, width and layer
    range a step (4 ints a row, whatever the depth), and a skipping round's skip sets [B, 2L] once a round — not a
    flag per row and sublayer a step."""
    stack, prompts, eos, _ = setup
    sizes, upload = [], static_steps.upload
    monkeypatch.setattr(static_steps, "upload", lambda values, device: sizes.append(len(values)) or upload(values,
                                                                                                        device))
    _, stats, _ = batched(stack, prompts, eos, method(case))
    per_round = 2 * stack.num_layers * B
    steps = [n for n in sizes if n != per_round]
    assert steps and all(n % 4 == 0 and n <= 4 * B for n in steps)
    assert 0 < sizes.count(per_round) <= stats["rounds"] if case == "clasp" else per_round not in sizes
