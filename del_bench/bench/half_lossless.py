"""Lossless in half precision: every method's greedy output vs generate's and our Vanilla's (no clock).

docs/design.md §2.8, del_bench/numerics.py: each output is equal, first departs at a near-tie (the reference's top-2
gap ≤ NEAR_TIE_ULPS ulps there), or departs for real.
`--model testbed`: the held-out code prompts of its training run (never trained on); `--model tiny`: the tests' tiny
random Llama (tests/conftest.py TINY) on short byte prompts; `--model random`: a Llama of bench gpu's `--shape`
(llama2-7b, llama3-8b, …) with random weights made on `--device` in the dtype, on the same byte prompts, no EOS.
Prints one line per (method, prompt) and the fractions; exits 1 if any output departs from either reference at
other than a near-tie.
"""

from __future__ import annotations

import json

import torch
from omegaconf import OmegaConf

from del_bench.bench import harness as h
from del_bench.bench.gpu import SHAPES, random_model
from del_bench.config import CONFIG_DIR
from del_bench.engine import path_choice
from del_bench.engine.compiled import COMPILE_CHOICES
from del_bench.engine.decode import Engine
from del_bench.engine.path_choice import stack_of
from del_bench.engine.sampling import Sampling
from del_bench.methods.dv import DraftVerify
from del_bench.methods.dynamic_exit import DEL
from del_bench.methods.fs import FiniteState
from del_bench.methods.ls import LayerSkip
from del_bench.methods.swift import Swift
from del_bench.methods.vanilla import Vanilla
from del_bench.models import loading
from del_bench.numerics import compare, gap_ulps

TINY = dict(hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4, num_kv_heads=2, init_std=0.1,
            late_residual_scale=0.3, seed=0)  # tests/conftest.py's
TINY_PROMPTS = ["def add(a, b):\n", "The quick brown fox", "x", "import os\nimport sys\n", "Once upon a time",
                "for i in range(10):"]


def methods(exit_layer: int) -> list[tuple[object, bool]]:
    """(method, counted in the issue's Vanilla/LS/DEL/SWIFT figure): the paper's methods at the model's default exit
    layer, DEL's CPU controller (restricted, deferred shadow scoring), SWIFT with its on-the-fly optimiser."""
    return [(Vanilla(), True), (LayerSkip(exit_layer, 4), True), (FiniteState(exit_layer, 2), False),
            (DraftVerify(exit_layer), False), (DEL(), True), (DEL(shadow_vocab=256, defer_shadow=True), False),
            (Swift(context_window=8, seed=0), True)]


def load_pair(args):
    """(reference model, model for our LayerStack, prompts as id lists, eos ids, the model's default exit layer),
    both models on args.device: two copies, since LayerStack re-lays the weights of its own."""
    dtype = loading.DTYPES[args.dtype]
    byte_prompts = [loading.ByteTokenizer()(p)["input_ids"] for p in TINY_PROMPTS[: args.prompts]]
    if args.model == "tiny":
        build = lambda: loading.build_tiny_random(OmegaConf.create({**TINY, "device": args.device}), dtype)  # noqa
        (ref, _), (ours, _) = build(), build()
        return ref.eval(), ours.eval(), byte_prompts, set(), 1
    if args.model == "random":  # the same seed on the same device: the same weights twice
        ref, ours = (random_model(SHAPES[args.shape], args.dtype, args.device, seed=0) for _ in range(2))
        return ref, ours, byte_prompts, set(), max(1, SHAPES[args.shape]["layers"] // 4)
    from del_bench.train.data import heldout_prompts

    cfg = OmegaConf.load(CONFIG_DIR / "model" / f"{args.model}.yaml")
    cfg.dtype, cfg.device = args.dtype, args.device
    ref, ours = loading.load(cfg), loading.load(cfg)
    exit_layer = cfg.get("default_exit_layer") or 1
    if cfg.source == "tiny_random":  # configs/model/tiny-random.yaml: no training run to hold prompts out of
        prompts = [ref.tokenizer(p)["input_ids"] for p in TINY_PROMPTS[: args.prompts]]
        return ref.model, ours.model, prompts, set(), exit_layer
    train_cfg = OmegaConf.load(loading.local_dir(cfg) / "train_config.yaml")
    rows = heldout_prompts(OmegaConf.to_container(train_cfg), args.prompts)
    prompts = [ref.tokenizer(r["prompt"])["input_ids"] for r in rows]
    eos = {ref.tokenizer.eos_token_id} - {None}
    return ref.model, ours.model, prompts, eos, exit_layer


def hf_reference(model, prompt: list[int], max_new_tokens: int, eos: set[int]) -> tuple[list[int], list[float]]:
    """generate's greedy tokens and its top-2 gap (ulps of the model's dtype) at each of them."""
    ids = torch.tensor([prompt], device=model.device)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
                             eos_token_id=sorted(eos) or None, pad_token_id=0, output_logits=True,
                             return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    return tokens, [gap_ulps(step[0], dtype=model.dtype) for step in out.logits]


def parse_args(argv: list[str]):
    ap = h.parser("half-lossless", __doc__, runs=False)
    ap.add_argument("--model", default="testbed",
                    help="testbed | tiny (the tests' TINY) | random (a Llama of --shape) | a model config")
    ap.add_argument("--shape", default="llama2-7b", choices=sorted(SHAPES), help="--model random's matrix sizes")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32", "float64"))
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--layers", default="auto", choices=("auto", "fused", "eager"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--compile", default="off", choices=COMPILE_CHOICES,
                    help="each method's graph-captured steps (engine/compiled.py), made and checked before it decodes")
    return ap.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    ref_model, model, prompts, eos, exit_layer = load_pair(args)
    refs = [hf_reference(ref_model, p, args.max_new_tokens, eos) for p in prompts]
    stack = stack_of(model, layers=args.layers)
    engine = Engine(stack, Sampling(), eos)
    rows = []
    vanilla: list = []
    graphs = {}
    for method, paper in methods(exit_layer):
        reach = max(map(len, prompts)) + args.max_new_tokens + 1
        engine.path = path_choice.choose(stack, args.compile, method, args.max_new_tokens, reach)
        graphs[method.name] = engine.path.info
        for i, (prompt, (ref, ref_gaps)) in enumerate(zip(prompts, refs)):
            gen = engine.generate(prompt, method, args.max_new_tokens, seed=0)
            if method.name == "vanilla":
                vanilla.append(gen)
            own = vanilla[i]
            rows.append({"method": method.name, "tag": f"{method.name}{method.describe()}", "paper": paper, "prompt": i,
                         "graph_kind": graphs[method.name].get("graph_kind"),
                         "vs_generate": compare(gen.output_ids, ref, ref_gaps).__dict__,
                         "vs_vanilla": compare(gen.output_ids, own.output_ids, own.top2_gap_ulps).__dict__})
            r = rows[-1]
            print(f"{r['tag'][:60]:60s} prompt {i}: generate {r['vs_generate']}  vanilla {r['vs_vanilla']}")
    summary = summarise(rows)
    print(json.dumps(summary, indent=1))
    h.write_result(args.out, "half-lossless", vars(args), layer_path=stack.layer_path, summary=summary, rows=rows,
                   graphs=graphs)
    return 0 if summary["real_departures"] == 0 else 1


def summarise(rows: list[dict]) -> dict:
    paper = [r for r in rows if r["paper"]]
    return {
        "outputs": len(rows),
        "equal_generate": sum(r["vs_generate"]["kind"] == "equal" for r in rows),
        "equal_vanilla": sum(r["vs_vanilla"]["kind"] == "equal" for r in rows),
        # the count: Vanilla, LS, DEL, SWIFT × prompts, equal to generate
        "paper_methods_equal_generate": f"{sum(r['vs_generate']['kind'] == 'equal' for r in paper)}/{len(paper)}",
        "near_ties": sum(r[k]["kind"] == "near_tie" for r in rows for k in ("vs_generate", "vs_vanilla")),
        "real_departures": sum(r[k]["kind"] in ("departs", "unknown") for r in rows
                               for k in ("vs_generate", "vs_vanilla")),
    }

