"""Decoder families beyond Llama (del_bench/models/families.py): a tiny random model of each, built with transformers'
own config classes, decodes with every method exactly as `generate` does (float64), its logits are HF's, and a saved
directory of each runs through the local model source (model=local model.path=DIR) in float32 like `generate`."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers as tf

from del_bench import runner
from del_bench.config import validate
from del_bench.engine.decode import Engine
from del_bench.engine.sampling import Sampling
from del_bench.errors import ConfigError
from del_bench.methods.adadecode import AdaDecode
from del_bench.methods.dv import DraftVerify
from del_bench.methods.dynamic_exit import DEL
from del_bench.methods.fs import FiniteState
from del_bench.methods.ls import LayerSkip
from del_bench.methods.swift import Swift
from del_bench.methods.vanilla import Vanilla
from del_bench.models.families import resolve
from del_bench.models.layer_stack import FamilyLayerStack, LayerStack
from del_bench.models.loading import REPO_ROOT, local_layers
from tests.conftest import compose_run
from tests.test_exit_adapters import random_adapters

WINDOW = 6  # shorter than the prompts and outputs: every windowed layer drops keys, in prefill, drafts and verification
# name → (config class, causal LM class, what the family adds, small enough to matter on a tiny model)
FAMILIES = {
    "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, dict(use_sliding_window=True, sliding_window=WINDOW,
                                                        max_window_layers=2)),
    "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, {}),
    "mistral": (tf.MistralConfig, tf.MistralForCausalLM, dict(sliding_window=WINDOW)),
    "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM, dict(sliding_window=WINDOW, query_pre_attn_scalar=24,
                                                           attn_logit_softcapping=1.0, final_logit_softcapping=2.0)),
    "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM, dict(
        sliding_window=WINDOW, query_pre_attn_scalar=24, final_logit_softcapping=2.0,
        layer_types=["sliding_attention", "full_attention"] * 2,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
    "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM, dict(sliding_window=WINDOW)),
}
L = 4
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=L, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, initializer_range=0.1, tie_word_embeddings=False)
PROMPTS = [[1, *range(10, 30)], [1, 200, 7, 7, 42]]  # 21 and 5 tokens: one prompt beyond the window, one inside it
BUDGET = 20


def tiny_family(name: str, dtype=torch.float64, vocab: int = 259, special: int = 1, seed: int = 0):
    """A seeded tiny random model of the family, in the attention implementation HF gives it by default (as
    `generate` runs it: eager for Gemma 2, which has no SDPA, SDPA elsewhere). Norm weights and biases are random
    (HF's zeros would hide Gemma's 1 + w and Qwen2's biases), and the later layers write less into the residual
    stream (their output norms, for Gemma's sandwich), so early exits agree with the last layer often but not always."""
    config_cls, model_cls, extra = FAMILIES[name]
    config = config_cls(**SHAPE, **extra, vocab_size=vocab, bos_token_id=special, eos_token_id=special + 1,
                        pad_token_id=0)
    torch.manual_seed(seed)
    model = model_cls(config).to(dtype).eval()
    gemma = resolve(config).family.norm == "gemma"
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "norm" in param_name:
                param.normal_(0.0 if gemma else 1.0, 0.2)
            elif param_name.endswith("bias"):
                param.normal_(0.0, 0.1)
        for layer in model.model.layers[1:]:
            if gemma:
                for norm in (layer.post_attention_layernorm, layer.post_feedforward_layernorm):
                    norm.weight.normal_(-0.7, 0.05)  # 1 + w ≈ 0.3
            else:
                layer.self_attn.o_proj.weight.mul_(0.3)
                layer.mlp.down_proj.weight.mul_(0.3)
    return model


def hf_greedy(model, prompt: list[int], max_new_tokens: int, eos=None) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    """(name, stack, references): the float64 model's greedy outputs by `generate`, then its LayerStack."""
    model = tiny_family(request.param)
    refs = [hf_greedy(model, prompt, BUDGET) for prompt in PROMPTS]
    return request.param, LayerStack(model), refs


METHODS = {
    "vanilla": Vanilla(), "ls": LayerSkip(1, 3), "fs": FiniteState(2, 2), "dv": DraftVerify(2, theta=0.3, d_max=5),
    "del": DEL(), "del-static-tpl": DEL(dynamic_draft_exit=False, draft_budget="tpl"),
    "del-lagging-shadow": DEL(shadow_every=3, shadow_vocab=50, defer_shadow=True),
    "swift-fixed": Swift(skip_set={"attn": [1], "mlp": [2]}),
    "swift-search": Swift(context_window=4, bayes_interval=3, scope="prompt", max_steps=8, bo_polish=False),
    "swift-tree": Swift(skip_set={"attn": [1, 2], "mlp": [2]}, confidence=0.0, d_max=5, tree=True),
    "adadecode": AdaDecode(gamma=0.0, head_layers=[1, 2]),
}
ADAPTED = [DEL(), AdaDecode(gamma=0.0, head_layers=[1, 2])]  # drafts (and DEL's shadow tokens) through exit adapters


def assert_greedy_equals_generate(stack, refs, method, prompts: int | None = None) -> None:
    """The method's greedy output is `generate`'s on each prompt (the first `prompts`), and no round drafts past the
    tokens left."""
    engine = Engine(stack, Sampling(), eos_ids=set())
    for prompt, ref in zip(PROMPTS[:prompts], refs):
        gen = engine.generate(prompt, method, BUDGET, seed=0)
        assert gen.output_ids == ref
        assert all(r.drafted <= BUDGET - 1 for r in gen.rounds)


@pytest.mark.parametrize("method", METHODS.values(), ids=METHODS.keys())
def test_every_method_greedy_equals_generate(family, method):
    _, stack, refs = family
    method.validate(L)
    assert_greedy_equals_generate(stack, refs, method)


def test_exit_adapters_stay_lossless(family):
    _, stack, refs = family
    stack.set_adapters(random_adapters(stack.norm_weight.shape[0]))
    try:
        for method in ADAPTED:
            assert_greedy_equals_generate(stack, refs, method, prompts=1)
    finally:
        stack.set_adapters(None)


def test_speculation_accepts_and_rejects(family):
    """Guard against vacuous equality: on each family's model drafts are both accepted and rejected."""
    _, stack, _ = family
    gen = Engine(stack, Sampling(), set()).generate(PROMPTS[0], LayerSkip(2, 4), BUDGET, seed=0)
    assert 0 < gen.accepted < gen.drafted


@pytest.mark.parametrize("name", list(FAMILIES))
def test_logits_are_hfs(name):
    """The prompt's logits through our layers, norm and head equal HF's forward (the final soft cap included, which
    greedy tokens cannot see), as tightly as float64 with Gemma's float32 norms allows."""
    model = tiny_family(name)
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        expected = model(ids).logits
    stack = LayerStack(model)
    cache = stack.new_cache(ids.shape[1])
    with torch.inference_mode():
        ours = stack.logits(stack.forward_layers(stack.embed(ids), 0, L, 0, cache))
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-7)


def test_shadow_confidences_read_the_capped_logits():
    """DEL's restricted shadow scoring (first K ids + each row's target) normalises the logits the head gives: Gemma's
    soft-capped ones (greedy tokens cannot see the cap; DEL's confidences, and so its decisions, can)."""
    stack = LayerStack(tiny_family("gemma2"))
    states = torch.randn(6, stack.norm_weight.shape[0], generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    targets = torch.tensor([3, 100, 7, 250, 40, 1])  # rows whose target lies outside the first K = 50 ids, and inside
    tokens, confidence = stack.shadow_tokens(states, targets, vocab=50)
    logits = stack.logits(states[None])[0]  # [N, V], capped
    scored = torch.zeros_like(logits, dtype=torch.bool)
    scored[:, :50] = True
    scored[torch.arange(6), targets] = True
    restricted = logits.masked_fill(~scored, float("-inf"))
    expected_conf, expected_tokens = restricted.softmax(-1).max(-1)
    assert tokens.tolist() == expected_tokens.tolist()
    torch.testing.assert_close(confidence, expected_conf, rtol=1e-9, atol=0)


def test_gemma3_multimodal_decodes_through_its_text_decoder():
    """gemma-3-4b/12b-it load as Gemma3ForConditionalGeneration: the stack reads its text decoder and text config
    (families.decoder_of) and decodes text-only prompts as its `generate` does."""
    text = tf.Gemma3TextConfig(**SHAPE, **FAMILIES["gemma3"][2], vocab_size=300, bos_token_id=1, eos_token_id=2,
                               pad_token_id=0)
    vision = tf.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                   image_size=28, patch_size=14)
    torch.manual_seed(0)
    model = tf.Gemma3ForConditionalGeneration(tf.Gemma3Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4, image_token_index=299,
        boi_token_index=297, eoi_token_index=298)).double().eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "language_model" in param_name and "norm" in param_name:
                param.normal_(0.0, 0.2)
    ref = hf_greedy(model, PROMPTS[0], 12)
    stack = LayerStack(model)
    assert (stack.math.family.name, stack.num_layers) == ("gemma3", L)
    assert Engine(stack, Sampling(), set()).generate(PROMPTS[0], LayerSkip(1, 3), 12, seed=0).output_ids == ref


def test_llama_math_keeps_the_llama_loop():
    """Families whose math is Llama's exactly keep LayerStack's own layer methods (the Llama path's speed); the
    others get FamilyLayerStack's."""
    ids = dict(vocab_size=259, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    llama = tf.LlamaForCausalLM(tf.LlamaConfig(**SHAPE, **ids)).double()
    assert type(LayerStack(llama)) is LayerStack
    phi3 = tf.Phi3ForCausalLM(tf.Phi3Config(**SHAPE, **ids)).double()  # no window: Llama's math, fused q|k|v
    assert type(LayerStack(phi3)) is LayerStack
    assert type(LayerStack(tiny_family("qwen3"))) is FamilyLayerStack


def test_an_undescribed_family_is_refused_naming_the_described(tmp_path):
    config = tf.OlmoConfig(**{k: v for k, v in SHAPE.items() if k != "head_dim"}, vocab_size=259, pad_token_id=0)
    with pytest.raises(ConfigError, match="'olmo' is not a described decoder family.*qwen3.*gemma2.*phi3"):
        LayerStack(tf.OlmoForCausalLM(config))
    config.save_pretrained(tmp_path)  # the local source: refused as the config resolves, before any weights load
    with pytest.raises(ConfigError, match="'olmo' is not a described"):
        local_layers(str(tmp_path))


HUB_MODELS = {"qwen2.5-7b-instruct": 28, "qwen3-8b": 36, "mistral-7b-instruct-v0.3": 32, "gemma-2-9b-it": 42,
              "gemma-3-4b-it": 34, "gemma-3-12b-it": 48, "phi-3-mini-4k-instruct": 32, "llama3.1-8b-instruct": 32}


def test_hub_family_configs_compose_without_loading():
    """The off-the-shelf checkpoints' configs compose; SWIFT and their default LS(E, γ) are valid for their depth."""
    for name, layers in HUB_MODELS.items():
        cfg = compose_run(f"model={name}", "method=swift")
        assert (cfg.model.num_layers, cfg.model.source, cfg.model.dtype) == (layers, "hub", "bfloat16")
        validate(cfg)
        LayerSkip(cfg.model.default_exit_layer, cfg.model.default_gamma).validate(layers)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_local_directory_runs_like_generate(name, tmp_path):
    """Our own check: the family's tiny model saved as an HF directory (the testbed's tokenizer beside it) runs
    through the local source in float32 — Vanilla, LS and SWIFT — and every output is `generate`'s."""
    directory = tmp_path / name
    tiny_family(name, torch.float32, vocab=2048, special=0).save_pretrained(directory)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(REPO_ROOT / "results" / "testbed" / file, directory / file)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "p0", "prompt": "def add(a, b):\n    return"}) + "\n")
    model = tf.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()  # HF's own load
    swift = ["method.context_window=4", "method.max_steps=10", "method.bo_polish=false"]  # a short search
    for method, settings in (("vanilla", []), ("ls", []), ("swift", swift)):
        out = tmp_path / method
        runner.run(compose_run("model=local", f"model.path={directory}", "task=prompts",
                               f"task.data_files={prompts}", f"method={method}", *settings, "max_new_tokens=10",
                               "warmup_tokens=0", "threads=1", f"out_dir={out}"))
        (sample,) = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
        assert sample["output_ids"] == hf_greedy(model, sample["prompt_ids"], 10, eos=0)
