"""Peer benchmark: our engine vs transformers on SmolLM2-135M (CPU, fp32, greedy, same prompts).

Rows: our Vanilla; HF `model.generate`; a plain loop over HF's forward with its DynamicCache (what
per-call overhead costs); and for each (E, γ): our LS vs HF `generate(assistant_early_exit=E,
num_assistant_tokens=γ)` (confidence threshold 0, so both draft exactly γ tokens). HF rows run on a
separately loaded, untouched model; our rows on the LayerStack view. Every row gets one untimed
warm-up generation. Prints a table and writes results/runs/bench/peer.json (--out).

    python scripts/bench_peer.py [--prompts 4] [--max-new-tokens 96] [--configs 24:4,27:3] [--layers auto]
                                 [--model smollm2-135m]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from del_bench.config import CONFIG_DIR
from del_bench.engine.decode import Engine
from del_bench.engine.sampling import Sampling
from del_bench.methods.ls import LayerSkip
from del_bench.methods.vanilla import Vanilla
from del_bench.models import loading
from del_bench.models.layer_stack import LayerStack
from del_bench.runner import eos_ids, provenance
from del_bench.tasks.humaneval import HumanEval


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def hf_generate(model, prompt_ids, max_new_tokens, eos, **kwargs):
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, eos_token_id=sorted(eos), pad_token_id=sorted(eos)[0],
                             **kwargs)
    return out[0, len(prompt_ids):].tolist()


def hf_forward_loop(model, prompt_ids, max_new_tokens, eos):
    """Greedy decoding with HF's own forward and DynamicCache, no generate() machinery."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    ids, out = torch.tensor([prompt_ids]), []
    with torch.inference_mode():
        while len(out) < max_new_tokens:
            logits = model(ids, past_key_values=cache, use_cache=True).logits[0, -1]
            out.append(int(logits.argmax()))
            if out[-1] in eos:
                break
            ids = torch.tensor([[out[-1]]])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="a configs/model name (tiny-random: the suite's smoke run)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--configs", default="24:4,27:3", help="comma-separated E:γ pairs")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", default="auto", choices=("auto", "fused", "eager"), help="our layer loop")
    ap.add_argument("--out", default="results/runs/bench/peer.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    configs = [tuple(int(x) for x in c.split(":")) for c in args.configs.split(",")]

    model_cfg = OmegaConf.load(CONFIG_DIR / "model" / f"{args.model}.yaml")
    hf = loading.load(model_cfg)  # untouched: the peer rows
    ours = loading.load(model_cfg)  # re-laid out by LayerStack
    tokenizer, eos = hf.tokenizer, eos_ids(hf.model, hf.tokenizer)
    samples = HumanEval().load()[: args.prompts]
    prompts = [list(tokenizer(s.prompt)["input_ids"]) for s in samples]
    engine = Engine(LayerStack(ours.model, layers=args.layers), Sampling(), eos)
    print(f"our layer loop: {engine.stack.layer_path}")
    M = args.max_new_tokens

    def ours_row(method):
        def gen(p, m):
            g = engine.generate(p, method, m, seed=0)
            return g.output_ids, g.wall_s, g
        return gen

    def hf_row(fn, **kw):
        def gen(p, m):
            out, wall = timed(lambda: fn(hf.model, p, m, eos, **kw))
            return out, wall, None
        return gen

    rows = [("ours vanilla", ours_row(Vanilla()), None), ("HF generate", hf_row(hf_generate), None),
            ("HF forward loop", hf_row(hf_forward_loop), None)]
    for e, g in configs:
        rows.append((f"ours LS(E={e}, γ={g})", ours_row(LayerSkip(e, g)), (e, g)))
        rows.append((f"HF assistant_early_exit(E={e}, γ={g})",
                     hf_row(hf_generate, assistant_early_exit=e, num_assistant_tokens=g,
                            assistant_confidence_threshold=0.0), (e, g)))

    # Interleaved: every prompt runs every row back to back, so drift of this shared machine over the
    # minutes of a benchmark hits all rows alike.
    for _, gen, _ in rows:
        gen(prompts[0], 8)  # warm-up, untimed
    stats = {name: {"speeds": [], "outputs": [], "etpl": [], "drafted": 0, "accepted": 0} for name, _, _ in rows}
    for i, p in enumerate(prompts):
        for name, gen, _ in rows:
            out, wall, g = gen(p, M)
            st = stats[name]
            st["outputs"].append(out)
            st["speeds"].append(len(out) / wall)
            if g is not None:
                st["etpl"].append(len(out) / g.loaded_layers)
                st["drafted"] += g.drafted
                st["accepted"] += g.accepted
        print(f"  prompt {i + 1}/{len(prompts)} done", flush=True)
    reference = stats["HF generate"]["outputs"]
    results = []
    for name, _, eg in rows:
        st = stats[name]
        results.append({"row": name, "exit_layer": eg[0] if eg else None, "gamma": eg[1] if eg else None,
                        "tokens_per_s": statistics.fmean(st["speeds"]), "per_prompt_tokens_per_s": st["speeds"],
                        "etpl": statistics.fmean(st["etpl"]) if st["etpl"] else None,
                        "acceptance": st["accepted"] / st["drafted"] if st["drafted"] else None,
                        "outputs": st["outputs"]})

    base = results[0]["tokens_per_s"]
    for r in results:
        r["ratio_vs_ours_vanilla"] = r["tokens_per_s"] / base
        r["equal_hf_greedy"] = [o == ref for o, ref in zip(r.pop("outputs"), reference)]
    by_name = {r["row"]: r for r in results}
    for e, g in configs:
        ours_r, hf_r = by_name[f"ours LS(E={e}, γ={g})"], by_name[f"HF assistant_early_exit(E={e}, γ={g})"]
        ours_r["ratio_vs_hf_same_config"] = ours_r["tokens_per_s"] / hf_r["tokens_per_s"]
    by_name["ours vanilla"]["ratio_vs_hf_generate"] = base / by_name["HF generate"]["tokens_per_s"]

    print(f"\nSmolLM2-135M fp32, {len(prompts)} HumanEval prompts, {M} new tokens, greedy, "
          f"{args.threads} threads\n")
    print(f"{'row':<38} {'tok/s':>7} {'vs ours van.':>12} {'eTPL':>6} {'accept':>6}  equal HF greedy")
    for r in results:
        eq = "yes" if all(r["equal_hf_greedy"]) else f"no ({sum(r['equal_hf_greedy'])}/{len(prompts)})"
        etpl = f"{r['etpl']:.3f}" if r["etpl"] else "-"
        acc = f"{r['acceptance']:.2f}" if r["acceptance"] is not None else "-"
        print(f"{r['row']:<38} {r['tokens_per_s']:>7.2f} {r['ratio_vs_ours_vanilla']:>11.2f}x {etpl:>6} {acc:>6}  {eq}")
    print(f"\nours vanilla / HF generate = {by_name['ours vanilla']['ratio_vs_hf_generate']:.2f}x")
    for e, g in configs:
        print(f"ours LS / HF assistant_early_exit at (E={e}, γ={g}) = "
              f"{by_name[f'ours LS(E={e}, γ={g})']['ratio_vs_hf_same_config']:.2f}x")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"settings": vars(args), "prompt_ids": [s.id for s in samples], "rows": results,
                               "provenance": provenance()}, indent=2) + "\n")
    print(f"written: {out}")


if __name__ == "__main__":
    main()
