"""models/synthetic.py: a random model at a real shape whose early exits agree with its last layer as often as asked —
calibrated, rising with depth, cached; every method lossless on it (float64 against `generate`), LS's per-token
acceptance near the agreement it was built for; its configs compose and keep runs of another agreement apart."""

from __future__ import annotations

import copy
import json
import random
from unittest import mock

import pytest
import torch
from omegaconf import OmegaConf

from del_bench.bench.gpu import token_acceptance
from del_bench.engine.decode import Engine
from del_bench.engine.sampling import Sampling
from del_bench.errors import ConfigError
from del_bench.methods.clasp import CLaSp
from del_bench.methods.dynamic_exit import DEL
from del_bench.methods.ls import LayerSkip
from del_bench.methods.swift import Swift
from del_bench.methods.vanilla import Vanilla
from del_bench.models import synthetic
from del_bench.models.layer_stack import LayerStack
from del_bench.models.loading import AnyIdTokenizer
from tests.conftest import compose_run
from tests.test_families import hf_greedy

E, AGREEMENT = 2, 0.8
SMALL = dict(shape="testbed", num_layers=6, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=128,
             vocab_size=512, default_exit_layer=E, agreement=AGREEMENT, seed=0, device="cpu", calibration_prompts=8,
             calibration_tokens=24)


def build(cache, **changes):
    return synthetic.build(OmegaConf.create({**SMALL, **changes}), torch.float64, AnyIdTokenizer(), cache)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build(tmp_path_factory.mktemp("cache"))


def test_the_agreement_asked_is_reached_and_rises_with_depth(model):
    """Calibrated at layer E to within the bisection's reach; lower before E, higher after, exactly 1 at the last
    layer; the matrices are the shape's (a layer streams a real layer's bytes)."""
    profile = model.synthetic["agreement_by_layer"]
    assert abs(profile[E - 1] - AGREEMENT) <= 0.05, profile
    assert profile[0] < profile[E - 1] < profile[-2] <= profile[-1] == 1.0
    assert model.synthetic["agreement"] == profile[E - 1] and 0 < model.synthetic["ratio"] < 1
    assert model.model.layers[0].mlp.down_proj.weight.shape == (64, 128) and model.lm_head.weight.shape == (512, 64)


def test_the_ratio_is_cached_and_the_weights_follow_the_seed(tmp_path, monkeypatch):
    """A second build takes r from the cache (no bisection) and gives the same weights; another agreement is
    calibrated anew."""
    first = build(tmp_path)
    cache = json.loads((tmp_path / "synthetic.json").read_text())
    assert list(cache.values()) == [first.synthetic["ratio"]]
    monkeypatch.setattr(synthetic, "calibrate", lambda *a: pytest.fail("calibrated again"))
    again = build(tmp_path)
    assert again.synthetic == {**first.synthetic, "build_s": again.synthetic["build_s"],
                               "calibration_s": again.synthetic["calibration_s"]}
    assert all(torch.equal(a, b) for a, b in zip(first.parameters(), again.parameters()))
    monkeypatch.undo()
    other = build(tmp_path, agreement=0.5)
    assert other.synthetic["ratio"] > first.synthetic["ratio"]  # less agreement: later layers write more


def prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [AnyIdTokenizer()(synthetic.random_text(rng, 16))["input_ids"] for _ in range(count)]


@pytest.mark.parametrize("method", [Vanilla(), LayerSkip(E, 3), DEL(), Swift(context_window=8, seed=0),
                                    CLaSp(skip_layers=1, interval=4)], ids=lambda m: m.name)
def test_every_method_is_lossless_on_a_synthetic_model(model, method):
    """float64: each method's greedy output is generate's, token for token."""
    stack = LayerStack(model)
    for prompt in prompts(2, seed=5):
        ours = Engine(stack, Sampling(), set()).generate(prompt, copy.deepcopy(method), 20, seed=0).output_ids
        assert ours == hf_greedy(model, prompt, 20)


def test_ls_accepts_drafts_about_as_often_as_the_agreement(model):
    """LS at the calibrated exit layer, on prompts of the calibration's kind (other draws): its per-token acceptance
    (accepted ÷ drafts compared) is within 0.1 of the agreement the model reached there."""
    stack = LayerStack(model)
    rounds = []
    for prompt in prompts(8, seed=7):
        gen = Engine(stack, Sampling(), set()).generate(prompt, LayerSkip(E, 3), 24, seed=0)
        rounds += [{"accepted": r.accepted, "drafted": r.drafted} for r in gen.rounds if r.round > 0]
    assert abs(token_acceptance(rounds) - model.synthetic["agreement"]) <= 0.1


def test_the_configs_compose_and_keep_agreements_apart():
    """Each synthetic config composes; a run of another agreement, seed or exit layer has other weights in its key
    (RunKey.weights), so it never pairs with or resumes as this one — and its own out_dir, named by those weights, so
    a sweep over agreements does not stop at a RunConflict in one directory."""
    for name in ("synthetic-llama2-7b", "synthetic-llama3-8b", "synthetic-smollm2", "synthetic-testbed"):
        cfg = compose_run(f"model={name}")
        assert synthetic.shape_of(cfg.model)["layers"] == cfg.model.num_layers
    runs = [compose_run("model=synthetic-smollm2", f"model.agreement={a}") for a in (0.6, 0.9)]
    assert len({cfg.model.weights for cfg in runs}) == 2
    for cfg in runs:
        assert cfg.out_dir.startswith(f"results/runs/{cfg.model.weights}/"), cfg.out_dir
    segments = compose_run("model=synthetic-smollm2", "model.agreement_profile=segments", "model.segment_tokens=128")
    assert "-segments-" in segments.out_dir and "-T128-" in segments.out_dir
    assert compose_run("model=tiny-random").out_dir.startswith("results/runs/tiny-random/")  # others: the name
    task_calibrated = compose_run("model=synthetic-smollm2", "model.calibrate_on=task").model.weights
    assert task_calibrated == compose_run("model=synthetic-smollm2").model.weights + "-cal-task"


ENGLISH = ["The committee met on Tuesday to discuss the budget for the coming year and agreed to review it again.",
           "She walked along the river in the morning, counting the boats that passed under the old stone bridge.",
           "Prices rose again last month as the cost of energy and food kept climbing across most of the country.",
           "The team scored twice in the second half and held on to win the final in front of a record crowd.",
           "Scientists said the new telescope would let them see the light of galaxies formed soon after the start.",
           "He opened the letter slowly, read it twice, and then put it back in the drawer without saying a word."]


def test_calibrated_on_texts_the_agreement_holds_on_texts_of_their_kind(tmp_path):
    """model.calibrate_on=task: calibrated on the given texts (their last tokens; the digest recorded, the cache keyed
    by it), the agreement asked is met on held-out texts of the same kind (within 0.1)."""
    tokenizer = AnyIdTokenizer()
    model = synthetic.build(OmegaConf.create(SMALL), torch.float64, tokenizer, tmp_path, texts=ENGLISH[:4])
    texts = synthetic.text_prompts(tokenizer, ENGLISH[:4], 512, 2048, "cpu")
    assert [t.tolist() for t in texts] == [[tokenizer(text)["input_ids"]] for text in ENGLISH[:4]]  # whole, own lengths
    assert synthetic.text_prompts(tokenizer, ENGLISH[:1], 512, 10, "cpu")[0].tolist() == [texts[0][0, -10:].tolist()]
    assert (model.synthetic["calibrated_on"], model.synthetic["calibration_ids"]) == ("task",
                                                                                      synthetic.ids_digest(texts))
    assert model.synthetic["calibration_prompt_lengths"] == [len(t[0]) for t in texts]
    assert len(json.loads((tmp_path / "synthetic.json").read_text())) == 1
    build(tmp_path)  # random text: its own cache entry, not the texts' constants
    assert len(json.loads((tmp_path / "synthetic.json").read_text())) == 2
    held_out = [tokenizer(text)["input_ids"] for text in ENGLISH[4:]]
    met = synthetic.agreement_on(model, held_out, 24)
    assert met["prompts"] == 2 and met["agreement_by_layer"][-1] == 1.0
    assert abs(met["agreement_by_layer"][E - 1] - AGREEMENT) <= 0.1, met
    with mock.patch.object(synthetic, "exit_matches", side_effect=AssertionError("measured again")):
        assert synthetic.agreement_on(model, held_out, 24) == met  # the same prompts again: measured once


def test_calibrate_on_run_meets_the_agreement_asked_on_the_runs_own_prompts(run_cfg, tmp_path, monkeypatch):
    """calibrate_on=run calibrates on the run's own selection (its prompts as it decodes them), so with
    calibration_tokens the run's length the agreement along its prompts is calibration's measurement itself; the
    weights name the selection (another limit or seed: another model, never resumed or paired as this one)."""
    from hydra.utils import instantiate

    from del_bench import session

    monkeypatch.setenv("DEL_BENCH_CACHE", str(tmp_path / "cache"))
    small = {k: v for k, v in SMALL.items() if k not in ("shape", "device")}
    overrides = ("model=synthetic-testbed", "model.tokenizer=bytes", "model.dtype=float64", "model.calibrate_on=run",
                 *(f"++model.{k}={v}" for k, v in small.items()))
    cfg = run_cfg(*overrides, "limit=3")
    assert cfg.model.weights.endswith(f"-cal-run-l3-s{cfg.seed}")
    assert run_cfg(*overrides, "limit=4").model.weights.endswith(f"-cal-run-l4-s{cfg.seed}")
    task = instantiate(cfg.task)
    samples = task.select(cfg.limit, cfg.seed)
    assert session.calibration_texts(cfg) == [s.prompt for s in samples]
    ready = session.build(cfg, task=task, samples=samples)
    recorded = ready.setup["synthetic"]
    assert recorded["calibrated_on"] == "run"
    assert recorded["on_run_prompts"]["agreement_by_layer"] == recorded["agreement_by_layer"]
    assert abs(recorded["agreement"] - AGREEMENT) <= 0.1
    with pytest.raises(ConfigError, match="calibrate_on=run"):
        session.calibration_texts(run_cfg(*overrides, "+sample_set=calibration"))


def test_calibrate_on_task_draws_outside_the_evaluation_and_the_run_records_its_own_prompts(run_cfg, tmp_path,
                                                                                           monkeypatch):
    """session: calibrate_on=task calibrates on the task's calibration draw (selection.calibration_samples, seeded
    by the model's seed) of the task the run built (not a second instance of it), and the setup records the agreement
    along the run's own prompts — which LS's acceptance on those prompts follows (within 0.15)."""
    from hydra.utils import instantiate

    from del_bench import session
    from del_bench.selection import calibration_samples

    monkeypatch.setenv("DEL_BENCH_CACHE", str(tmp_path / "cache"))
    small = {k: v for k, v in SMALL.items() if k not in ("shape", "device")}
    cfg = run_cfg("model=synthetic-testbed", "model.tokenizer=bytes", "model.dtype=float64", "model.calibrate_on=task",
                  "limit=3", *(f"++model.{k}={v}" for k, v in small.items()))
    task = instantiate(cfg.task)
    assert session.calibration_texts(cfg) == [s.prompt for s in calibration_samples(task, 8, 0, None)]
    samples = task.select(cfg.limit, cfg.seed)
    method = instantiate(cfg.method)
    with mock.patch.object(session, "instantiate", side_effect=AssertionError("the run's task built again")):
        ready = session.build(cfg, task=task, method=method, samples=samples)  # calibrates on the task it is given
    recorded = ready.setup["synthetic"]
    assert recorded["calibrated_on"] == "task" and ready.loaded.model.synthetic == {
        k: v for k, v in recorded.items() if k != "on_run_prompts"}
    on_run = recorded["on_run_prompts"]
    assert (on_run["prompts"], on_run["tokens"], len(on_run["agreement_by_layer"])) == (3, 24, 6)
    rounds = []
    for ids in session.prompt_ids(samples, ready.task, ready.tokenizer):
        gen = Engine(ready.stack, Sampling(), set()).generate(ids, LayerSkip(E, 3), 24, seed=0)
        rounds += [{"accepted": r.accepted, "drafted": r.drafted} for r in gen.rounds if r.round > 0]
    assert abs(token_acceptance(rounds) - on_run["agreement_by_layer"][E - 1]) <= 0.15
