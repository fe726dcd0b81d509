"""Exit adapters: the fit recovers a known linear relation and raises agreement, a train-exits directory round-trips
and loads offline, drafting and DEL's shadow tokens go through the adapter, and outputs stay lossless."""

from __future__ import annotations

import json

import pytest
import torch
from omegaconf import OmegaConf

from del_bench.engine.decode import Engine
from del_bench.engine.sampling import Sampling
from del_bench.methods.dv import DraftVerify
from del_bench.methods.dynamic_exit import DEL
from del_bench.methods.fs import FiniteState
from del_bench.methods.ls import LayerSkip
from del_bench.models import exit_adapters
from del_bench.models.exit_adapters import ExitAdapters
from del_bench.models.layer_stack import LayerStack
from del_bench.records import RunKey
from del_bench.train.exits import agreement, closed_form
from tests.conftest import tiny_model
from tests.test_engine import PROMPTS, hf_greedy

L = 4


def random_adapters(dim: int, layers=(1, 2, 3), scale=0.3, seed=0, dtype=torch.float64) -> ExitAdapters:
    g = torch.Generator().manual_seed(seed)
    n = len(layers)
    noise = torch.randn(n, dim, dim, generator=g, dtype=dtype) / dim**0.5
    weight = torch.eye(dim, dtype=dtype).repeat(n, 1, 1) + scale * noise
    return ExitAdapters(list(layers), weight, 0.1 * torch.randn(n, dim, generator=g, dtype=dtype))


def test_closed_form_recovers_a_known_linear_relation_and_raises_agreement():
    """States built with norm(h_L) = norm(h_ℓ) @ M + c (+ a little noise): the own head (M = I) rarely agrees, the
    fitted adapter recovers M and c and agrees almost always."""
    model, _ = tiny_model()
    stack = LayerStack(model)
    D = stack.norm_weight.shape[0]
    g = torch.Generator().manual_seed(1)
    M = torch.linalg.qr(torch.randn(D, D, generator=g, dtype=torch.float64))[0] * 2.0  # a rotation, scaled
    c = 0.5 * torch.randn(D, generator=g, dtype=torch.float64)
    X = torch.randn(2, 3000, D, generator=g, dtype=torch.float64)  # two "layers"
    Y = X[0] @ M + c + 1e-3 * torch.randn(3000, D, generator=g, dtype=torch.float64)
    X1 = torch.cat([X, torch.ones(2, 3000, 1, dtype=torch.float64)], -1)
    xtx, xty = X1.transpose(1, 2) @ X1, X1.transpose(1, 2) @ Y[None]
    A, b = closed_form(xtx, xty, ridge=1e-9, bias=True)
    assert torch.allclose(A[0].double(), M, atol=1e-2) and torch.allclose(b[0].double(), c, atol=1e-2)
    held = slice(2000, 3000)
    before = agreement(stack, X[:, held].float(), Y[held].float(), None, None)["agreement"]
    after = agreement(stack, X[:, held].float(), Y[held].float(), A, b)["agreement"]
    assert before[0] < 0.5 and after[0] > 0.98
    # without the bias column the fit cannot reach c: worse than with it
    A0, b0 = closed_form(xtx, xty, ridge=1e-9, bias=False)
    assert float(b0.abs().max()) == 0.0
    assert agreement(stack, X[:, held].float(), Y[held].float(), A0, b0)["agreement"][0] < after[0]


def test_save_load_round_trip_and_digest(tmp_path):
    adapters = random_adapters(8, layers=(1, 3))
    adapters.save(tmp_path / "a", {"model": {"name": "tiny-random"}, "note": "x"})
    back = exit_adapters.load(tmp_path / "a")
    assert back.layers == [1, 3] and back.record["note"] == "x"
    assert torch.equal(back.weight, adapters.weight.float()) and torch.equal(back.bias, adapters.bias.float())
    d = exit_adapters.digest(tmp_path / "a")
    assert len(d) == 16 and d == exit_adapters.digest(tmp_path / "a")
    # runs with adapters are another model variant: other weights, another out_dir
    assert exit_adapters.variant_weights("", None) == ""
    variant = exit_adapters.variant_weights("", str(tmp_path / "a"))
    assert variant not in ("", exit_adapters.variant_weights("x", str(tmp_path / "a")))
    assert exit_adapters.model_variant("m", str(tmp_path / "a")) == f"m+exits-{d[:8]}"
    random_adapters(8, layers=(1, 3), seed=5).save(tmp_path / "a", {})
    assert exit_adapters.digest(tmp_path / "a") != d  # retrained at the same path: a new variant


def test_exit_head_uses_the_adapter_and_the_identity_adapter_is_the_own_head():
    model, _ = tiny_model()
    stack = LayerStack(model)
    D = stack.norm_weight.shape[0]
    h = torch.randn(1, 3, D, dtype=torch.float64)
    own = stack.exit_logits(h, 2)
    stack.set_adapters(ExitAdapters.identity([1, 2, 3], D, torch.float64))
    assert torch.allclose(stack.exit_logits(h, 2), own)
    adapters = random_adapters(D)
    stack.set_adapters(adapters)
    expected = stack.head(stack.norm(h) @ adapters.weight[1] + adapters.bias[1])
    assert torch.allclose(stack.exit_logits(h, 2), expected)
    # shadow tokens: each row through its own layer's adapter
    states = torch.randn(6, D, dtype=torch.float64)
    layers = torch.tensor([1, 1, 2, 2, 3, 3])
    tokens, conf = stack.shadow_tokens(states, layers=layers)
    for i in range(6):
        probs = stack.exit_logits(states[i][None, None], int(layers[i]))[0, 0].softmax(-1)
        assert int(tokens[i]) == int(probs.argmax()) and float(conf[i]) == pytest.approx(float(probs.max()))
    stack.set_adapters(None)


@pytest.fixture(scope="module")
def adapted():
    model, tok = tiny_model()
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    refs = [hf_greedy(model, p, 40) for p in prompts]
    stack = LayerStack(model)
    stack.set_adapters(random_adapters(stack.norm_weight.shape[0]))
    return stack, prompts, refs


METHODS = ([LayerSkip(e, g) for e, g in [(1, 1), (1, 4), (2, 3), (3, 2), (2, 50)]]
           + [FiniteState(1, 2), DraftVerify(1), DraftVerify(2, theta=0.3, d_max=5)]
           + [DEL(), DEL(dynamic_draft_exit=False, draft_budget="tpl"), DEL(exit_layer=2), DEL(min_exit_layer=2),
              DEL(cost_model="measured", shadow_vocab=50, defer_shadow=True)])


@pytest.mark.parametrize("method", METHODS, ids=lambda m: f"{m.name}{m.describe()}")
def test_greedy_with_adapters_equals_hf_generate(adapted, method):
    stack, prompts, refs = adapted
    if method.wants_costs:
        method.head_cost = 2.0
    engine = Engine(stack, Sampling(), eos_ids=set())
    for prompt, ref in zip(prompts, refs):
        for budget in (1, 7, 40):
            assert engine.generate(prompt, method, budget, seed=0).output_ids == ref[:budget]
    eos = refs[0][5]
    engine = Engine(stack, Sampling(), eos_ids={eos})
    assert engine.generate(prompts[0], method, 40, seed=0).output_ids == refs[0][: refs[0].index(eos) + 1]


def test_drafts_come_from_the_adapter_and_are_counted(adapted):
    stack, prompts, _ = adapted
    gen = Engine(stack, Sampling(), set()).generate(prompts[0], LayerSkip(1, 4), 30, seed=0)
    assert 0 < gen.accepted < gen.drafted
    assert sum(r.adapter_rows for r in gen.rounds) == sum(r.drafted for r in gen.rounds if r.drafted) > 0
    adapters, stack.adapters = stack.adapters, None
    try:
        own = Engine(stack, Sampling(), set()).generate(prompts[0], LayerSkip(1, 4), 30, seed=0)
    finally:
        stack.adapters = adapters
    assert own.output_ids == gen.output_ids and sum(r.adapter_rows for r in own.rounds) == 0
    assert [r.accepted for r in own.rounds] != [r.accepted for r in gen.rounds]  # other drafts


def test_del_shadow_tokens_use_the_adapters(adapted):
    """DEL's statistics with adapters are those of adapter-headed drafts: equal to scoring the states by hand."""
    stack, prompts, _ = adapted
    seen = []

    class Spy(DEL):
        def observe_prefill(self, shadow):
            seen.append(shadow)
            super().observe_prefill(shadow)

    Engine(stack, Sampling(), set()).generate(prompts[0], Spy(), 3, seed=0)
    shadow = seen[0]
    for layer in (1, 2, 3):
        probs = stack.exit_logits(shadow.states[layer - 1][None], layer)[0].softmax(-1)
        assert torch.equal(shadow.tokens[layer - 1], probs.argmax(-1))


def test_model_config_with_adapters_is_its_own_variant(tmp_path):
    from tests.conftest import compose_run

    random_adapters(64).save(tmp_path / "ad", {"model": {"name": "tiny-random"}})
    own = compose_run("model=tiny-random")
    with_ad = compose_run("model=tiny-random", f"model.exit_adapters={tmp_path / 'ad'}")
    assert own.model.exit_adapters is None and own.out_dir.startswith("results/runs/tiny-random/")
    digest = exit_adapters.digest(tmp_path / "ad")
    assert with_ad.out_dir.startswith(f"results/runs/tiny-random+exits-{digest[:8]}/")


def test_runs_with_adapters_never_pair_with_own_head_runs(tmp_path):
    from del_bench import runner

    random_adapters(64).save(tmp_path / "ad", {"model": {"name": "tiny-random"}})
    from tests.conftest import compose_run

    summaries = {}
    for name, extra in (("own", []), ("ad", [f"model.exit_adapters={tmp_path / 'ad'}"])):
        for method in ("vanilla", "ls"):
            cfg = compose_run("model=tiny-random", "task=humaneval", "limit=1", "max_new_tokens=8", "warmup_tokens=0",
                              "threads=1", f"method={method}", f"out_dir={tmp_path / name / method}", *extra)
            summaries[name, method] = runner.run(cfg)
    keys = {k: RunKey.from_dict(s["run_key"]) for k, s in summaries.items()}
    assert keys["ad", "ls"].pairs_with(keys["ad", "vanilla"]) and keys["own", "ls"].pairs_with(keys["own", "vanilla"])
    assert not keys["ad", "ls"].pairs_with(keys["own", "vanilla"])
    assert not keys["own", "ls"].pairs_with(keys["ad", "vanilla"])
    assert keys["ad", "ls"].weights != keys["own", "ls"].weights == ""
    run_config = json.loads((tmp_path / "own" / "ls" / "run_config.json").read_text())
    assert "exit_adapters" not in run_config["model"]  # own-head runs keep the fingerprint of older records
    assert summaries["ad", "ls"]["config"]["model"]["exit_adapters"] == str(tmp_path / "ad")


def test_train_exits_on_a_tiny_model_writes_loadable_adapters_and_resumes(tmp_path):
    from del_bench.session import load_model
    from del_bench.train.exits import model_config, train

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"def f{i}(x):\n    return x + {i}"}) + "\n" for i in range(30)))
    cfg = OmegaConf.load("configs/train/exits.yaml")
    del cfg["defaults"], cfg["hydra"]
    cfg.merge_with({"model": "tiny-random", "data_files": str(prompts), "out_dir": str(tmp_path / "out"),
                    "new_tokens": 12, "gen_batch": 8, "heldout_prompts": 3, "heldout_rows": 64, "threads": 1,
                    "kl": {"steps": 4, "batch": 8, "rows": 256, "checkpoint_every": 2}})
    out = train(cfg)
    record = json.loads((out / "adapters.json").read_text())
    assert record["layers"] == [1, 2, 3] and record["steps"]["kl_steps"] == 4
    a = record["agreement"]
    assert sum(a["closed_form"]["agreement"]) >= sum(a["own_head"]["agreement"])
    assert (out / "work" / "kl.pt").is_file()
    digest = record["digest"]
    # rerun: resumes from the checkpoint (no step left) and writes the same adapters
    cfg2 = cfg.copy()
    assert train(cfg2) and exit_adapters.digest(out) == digest
    # another setting into the same out_dir is refused
    cfg3 = cfg.copy()
    cfg3.bias = False
    with pytest.raises(Exception, match="other settings"):
        train(cfg3)
    model_cfg = model_config("tiny-random")
    model_cfg.exit_adapters = str(out)
    _, stack = load_model(model_cfg)
    assert stack.adapters is not None and stack.adapters.layers == [1, 2, 3]
