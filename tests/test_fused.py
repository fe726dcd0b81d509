"""The fused decoder-layer loop (del_bench/models/fused_layers.cpp) is the eager loop's arithmetic: the same tokens,
the same per-round decisions and the same sampled draws for every method; `layers=auto` checks that on the machine
at hand and falls back to eager when it does not hold."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import threading

import pytest
import torch

from del_bench import runner
from del_bench.engine.decode import Engine
from del_bench.engine.path_choice import stack_of
from del_bench.engine.sampling import Sampling
from del_bench.methods.dynamic_exit import DEL
from del_bench.methods.ls import LayerSkip
from del_bench.methods.swift import Swift
from del_bench.models import fused
from del_bench.models.kv_cache import TreeMask
from del_bench.models.layer_stack import LayerStack
from del_bench.records import RunDir, run_key_of
from tests.conftest import tiny_model
from tests.test_engine import METHODS, PRODUCTS, PROMPTS, hf_greedy

SWIFT = [Swift(skip_set={"attn": [1], "mlp": [2]}), Swift(skip_set={"attn": [1, 2], "mlp": [1, 2]}, confidence=0.0,
                                                          d_max=4, tree=True)]


@pytest.fixture(scope="module", params=PRODUCTS)
def stacks(request):
    """(eager stack, fused stack, prompts, HF's greedy references) on two copies of one float64 tiny model, under each
    forced product layout (the fused loop reads it from the matrices it is given)."""
    model, tok = tiny_model()
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    refs = [hf_greedy(model, p, 40) for p in prompts]
    fused_stack = stack_of(tiny_model()[0], layers="fused", products=request.param)
    assert fused_stack.layer_path == "fused"
    return LayerStack(model, products=request.param), fused_stack, prompts, refs


def decisions(gen) -> list[tuple]:
    return [(r.exit_layer, r.budget, r.drafted, r.accepted, r.emitted, r.loaded_layers, r.head_calls, r.shadow_rows,
             sorted((k, str(v)) for k, v in r.trace.items() if not k.endswith("_s"))) for r in gen.rounds]


@pytest.mark.parametrize("method", METHODS + SWIFT, ids=lambda m: f"{m.name}{m.describe()}")
def test_fused_greedy_equals_hf_and_eager_round_by_round(stacks, method):
    eager, fused_stack, prompts, refs = stacks
    for prompt, ref in zip(prompts, refs):
        a = Engine(eager, Sampling(), set()).generate(prompt, method, 40, seed=0)
        b = Engine(fused_stack, Sampling(), set()).generate(prompt, method, 40, seed=0)
        assert b.output_ids == ref
        assert decisions(b) == decisions(a)


@pytest.mark.parametrize("method", [METHODS[2], METHODS[-2], SWIFT[1]], ids=lambda m: m.name)
def test_fused_sampling_draws_what_eager_draws(stacks, method):
    """The same bits give the same accept/reject tests: every seed's sampled output is eager's."""
    eager, fused_stack, prompts, _ = stacks
    sampling = Sampling(do_sample=True, temperature=1.2)
    for seed in range(8):
        a = Engine(eager, sampling, set()).generate(prompts[1], method, 24, seed=seed)
        b = Engine(fused_stack, sampling, set()).generate(prompts[1], method, 24, seed=seed)
        assert b.output_ids == a.output_ids


def test_fused_cache_and_collected_states_are_eager_bits(stacks):
    eager, fused_stack, prompts, _ = stacks
    out = []
    for stack in (eager, fused_stack):
        cache, states = stack.new_cache(64), []
        h = stack.forward_layers(stack.embed(torch.tensor([prompts[0]])), 0, stack.num_layers, 0, cache, states)
        h2 = stack.forward_layers(stack.embed(torch.tensor([[7]])), 0, 2, len(prompts[0]), cache)
        out.append((h, h2, states, cache.k, cache.v, list(cache.lengths)))
    (h, h2, states, k, v, lengths), (fh, fh2, fstates, fk, fv, flengths) = out
    assert torch.equal(h, fh) and torch.equal(h2, fh2) and lengths == flengths
    assert all(torch.equal(a, b) for a, b in zip(states, fstates))
    filled = [(a[:, :, :n], b[:, :, :n]) for a, b, n in zip(k + v, fk + fv, lengths + lengths)]  # the rest: empty
    assert all(torch.equal(a, b) for a, b in filled)


class _OffByOneUlp:
    """A fused loop that is not the eager arithmetic: the negative control of the self-check."""

    def __init__(self, real):
        self.real = real

    def forward_layers(self, *args):
        return [t + t.abs() * 1e-15 for t in self.real.forward_layers(*args)]


def test_auto_falls_back_to_eager_when_the_bits_differ(monkeypatch):
    model = tiny_model()[0]
    wrong = _OffByOneUlp(fused.extension())
    monkeypatch.setattr(fused, "extension", lambda: wrong)
    stack = stack_of(model, layers="auto")
    assert stack.layer_path == "eager" and stack.fused is None
    with pytest.raises(fused.FusedUnavailable, match="layer outputs differ"):
        stack_of(model, layers="fused")


def test_auto_is_fused_here_and_models_it_cannot_run_stay_eager():
    assert stack_of(tiny_model()[0], layers="auto").layer_path == "fused"  # this machine builds it
    assert stack_of(family_model("gemma2", torch.float64), layers="auto").layer_path == "fused"
    exact_gelu = tiny_model()[0]
    exact_gelu.config.hidden_act = "gelu"  # an activation the C++ loop does not compute (eager runs ACT2FN's)
    assert stack_of(exact_gelu, layers="auto").layer_path == "eager"
    with pytest.raises(fused.FusedUnavailable, match="activation 'gelu' is not in the C\\+\\+ loop"):
        stack_of(exact_gelu, layers="fused")
    with pytest.raises(ValueError, match="choose one of auto, fused, eager"):
        stack_of(tiny_model()[0], layers="fast")


def test_records_say_which_loop_decoded_and_loops_never_pair(run_cfg, tmp_path):
    """Each sample records its loop, the run's machine names it (so a speedup never pairs eager with fused), and
    setup.jsonl keeps the untimed setup of every decoding session apart; a resume under another loop shows in both."""
    fused_run = runner.run(run_cfg("method=vanilla", "limit=1", "layers=fused"))
    assert fused_run["run_key"]["machine"].endswith("fused layers)")
    resumed = runner.run(run_cfg("method=vanilla", "limit=2", "layers=eager"))  # `layers` may change on resume
    run_dir = RunDir(resumed["config"]["out_dir"])
    assert [r["layer_path"] for r in run_dir.finished()] == ["fused", "eager"]
    assert [s["layer_path"] for s in run_dir.setup()] == ["fused", "eager"] == [s["layer_path"] for s in
                                                                                 resumed["setup"]]
    assert all(s["layer_setup_s"] >= 0 and s["warmup_s"] >= 0 for s in run_dir.setup())
    assert resumed["run_key"]["machine"].endswith("eager+fused layers)")
    cfg = run_cfg("method=vanilla", "limit=1", "layers=eager")
    cfg.out_dir = str(tmp_path / "eager")
    eager_run = runner.run(cfg)
    assert run_key_of(eager_run).machine == run_key_of(fused_run).machine.replace(", fused layers", "")
    assert not run_key_of(fused_run).pairs_with(run_key_of(eager_run))


def test_each_version_of_the_source_builds_in_its_own_directory(tmp_path, monkeypatch):
    """Two checkouts of different C++ sources on one machine (a branch, a mutant copy) must not rebuild over each
    other's module; the same source always finds its own build."""
    here = fused.build_dir()
    assert here == fused.build_dir() and here.parent.name == f"torch-{torch.__version__}"
    other = tmp_path / "fused_layers.cpp"
    other.write_bytes(fused.SOURCE.read_bytes() + b"// another version\n")
    monkeypatch.setattr(fused, "SOURCE", other)
    assert fused.build_dir() != here and fused.build_dir().parent == here.parent


def test_a_lock_left_by_a_killed_build_is_removed_and_a_live_one_kept(tmp_path):
    """torch's `lock` file left by a killed load must not hang the next one (CI did, forever); one whose loader is
    alive stays until that loader ends — here, until it is killed, as a session's runs are when it stops."""
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time, pathlib; from del_bench.models import fused\n"
        "d = pathlib.Path(sys.argv[1])\n"
        "with fused.build_lock(d):\n"
        "    (d / 'lock').touch(); print('held', flush=True); time.sleep(60)\n"), str(tmp_path)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        entered = threading.Event()

        def load():
            with fused.build_lock(tmp_path):
                entered.set()

        waiter = threading.Thread(target=load, daemon=True)
        waiter.start()
        assert not entered.wait(1.0) and (tmp_path / "lock").exists()  # a live load: wait for it, keep its lock
    finally:
        holder.kill()
        holder.wait()
    assert entered.wait(30.0)  # killed: its kernel lock went with it, and the file it left is removed
    waiter.join(30.0)
    assert not (tmp_path / "lock").exists()


def test_a_failed_build_is_a_warning_with_its_reason_and_the_stack_says_eager(monkeypatch, caplog):
    def no_compiler():
        raise fused.FusedUnavailable("building fused_layers.cpp failed (no C++ compiler)")

    monkeypatch.setattr(fused, "extension", no_compiler)
    with caplog.at_level(logging.WARNING, logger=fused.log.name):
        stack = stack_of(tiny_model()[0], layers="auto")
    assert stack.layer_path == "eager" and stack.fused is None
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "no C++ compiler" in warning.getMessage() and "eager" in warning.getMessage()
    with pytest.raises(fused.FusedUnavailable, match="no C\\+\\+ compiler"):
        stack_of(tiny_model()[0], layers="fused")


def test_ninja_beside_the_interpreter_is_found_without_an_activated_venv(monkeypatch, tmp_path):
    """`pip install ninja` (a dependency) puts it in the venv's bin, off PATH when .venv/bin/python runs directly."""
    monkeypatch.setenv("PATH", str(tmp_path))  # no ninja there; monkeypatch restores PATH afterwards
    assert shutil.which("ninja") is None
    assert fused.put_ninja_on_path()
    assert shutil.which("ninja")


# ---- every described family (models/families.py) in the C++ loop, bit for bit with the eager loop ----
WINDOW = 4  # a sliding window shorter than the prompts, so windowed layers mask and narrow
FAMILY_CONFIGS = {  # case: (family, transformers' own config class, its settings), tiny; each case switches on its
    # family's variations
    "qwen2": ("qwen2", "Qwen2Config", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2)),
    "qwen2-full": ("qwen2", "Qwen2Config", {}),  # Llama's math plus q|k|v biases: the plain LayerStack
    "qwen3": ("qwen3", "Qwen3Config", dict(head_dim=16)),
    "mistral": ("mistral", "MistralConfig", dict(sliding_window=WINDOW)),
    "gemma2": ("gemma2", "Gemma2Config", dict(head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24,
                                              attn_logit_softcapping=2.0, final_logit_softcapping=5.0)),
    "gemma3": ("gemma3", "Gemma3TextConfig", dict(head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24,
                                                  layer_types=["sliding_attention", "full_attention"] * 2)),
    "phi3": ("phi3", "Phi3Config", dict(sliding_window=WINDOW)),
}


def family_model(case: str, dtype: torch.dtype):
    """A tiny random causal LM of FAMILY_CONFIGS[case], every weight (norms and biases too) drawn N(0, 0.1), seeded."""
    import transformers

    _, class_name, extra = FAMILY_CONFIGS[case]
    config = getattr(transformers, class_name)(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, bos_token_id=1, eos_token_id=2, pad_token_id=0, **extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(dtype).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.1)
    return model


def layer_results(stack, ext, prompt: list[int]) -> list[torch.Tensor]:
    """Every layer output and cache entry `stack` computes with the loop `ext` (None: eager) over each kind of call:
    a prefill longer than the window, single decode steps past it, a chain over the cache (verification), a token
    tree (SWIFT's) and an early-layer draft step (layers [0, 2))."""
    stack.fused = ext
    cache, out = stack.new_cache(32), []
    P = len(prompt)
    stack.forward_layers(stack.embed(torch.tensor([prompt])), 0, stack.num_layers, 0, cache, collect=out)
    for pos in (P, P + 1):
        stack.forward_layers(stack.embed(torch.tensor([[pos % 50 + 3]])), 0, stack.num_layers, pos, cache,
                             collect=out)
    out.append(stack.forward_layers(stack.embed(torch.tensor([[5, 9, 11]])), 0, 2, P + 2, cache))
    chain = stack.embed(torch.tensor([[7, 8, 9, 10]]))
    stack.forward_layers(chain, 0, stack.num_layers, P + 2, cache, collect=out)
    tree = TreeMask.of([-1, 0, 0, 1, 2])
    stack.forward_layers(stack.embed(torch.tensor([[4, 6, 12, 13, 14]])), 0, stack.num_layers, P + 6, cache,
                         collect=out, tree=tree)
    n = P + 11
    return out + [t[:, :, :n] for t in cache.k + cache.v]


@pytest.fixture(scope="module")
def extension():
    return fused.extension()


# bfloat16 on CPU: verification and trees attend row by row (exact_rows), the windowed masks' gathered keys too
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", list(FAMILY_CONFIGS))
def test_every_family_runs_fused_with_the_eager_bits(extension, case, dtype):
    stack = stack_of(family_model(case, dtype), layers="fused")  # fused.check passed at load
    assert stack.layer_path == "fused" and stack.math.family.name == FAMILY_CONFIGS[case][0]
    prompt = [3, 17, 29, 41, 8, 22, 35, 11, 19]  # 9 positions > WINDOW
    eager = layer_results(stack, None, prompt)
    fused_bits = layer_results(stack, extension, prompt)
    assert len(eager) == len(fused_bits)
    differ = [i for i, (a, b) in enumerate(zip(eager, fused_bits)) if not torch.equal(a, b)]
    assert differ == [], f"{case} {dtype}: results {differ} of {len(eager)} differ"


@pytest.mark.parametrize("case", list(FAMILY_CONFIGS))
def test_every_family_decodes_fused_as_eager_and_generate(case):
    """Through the engine's own calls (DEL's trimmed prefill, drafts from an exit layer, SWIFT's token tree): the
    fused loop's tokens are `generate`'s and its rounds eager's."""
    model = family_model(case, torch.float64)
    prompt = [3, 17, 29, 41, 8, 22, 35, 11, 19]
    ref = hf_greedy(model, prompt, 16)
    stack = stack_of(model, layers="fused")
    fused_loop = stack.fused
    for method in (LayerSkip(2, 3), DEL(), SWIFT[1]):
        stack.fused = None
        eager = Engine(stack, Sampling(), set()).generate(prompt, method, 16, seed=0)
        stack.fused = fused_loop
        gen = Engine(stack, Sampling(), set()).generate(prompt, method, 16, seed=0)
        assert gen.output_ids == ref and decisions(gen) == decisions(eager), method.name
