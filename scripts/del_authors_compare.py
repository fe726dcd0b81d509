"""DEL against its authors' code, round by round: the same weights, the same prompt ids, greedy.

Three steps, each a subcommand (docs/design.md §3.5, README "DEL against its authors' code"):

  export   (our .venv)       the testbed (or any local HF Llama directory) as a directory their transformers loads:
                             float32 weights, a config with `rope_theta` and `torch_dtype` (transformers 4.45 reads
                             those, not 5.x's `rope_parameters` and `dtype`)
  drive    (their python)    their DEL generator (`self_speculation/DEL_speculation_generator.py` of a checkout of
                             GitHub's hoenza/DEL, commit 0365a81) over the prompt ids of one of our runs; one JSONL
                             line per prompt with its rounds: exit layer, drafted, accepted, emitted, the output offset
                             it started at, τ and TPL's γ as their controller held them
  compare  (any python)      their JSONL against one of our runs' rounds.jsonl: rounds aligned by the output offset
                             they start at, the agreement table, the differences by kind, eTPL and α of each side

Nothing of their code is copied here: `drive` imports it from the checkout named by --authors and wraps one method
(`single_step_speculation`) to record what each call decided. It needs their python (torch, transformers==4.45.2,
colorama, matplotlib, lxml: what their modules import) and none of ours; this file imports only the standard
library at the top, so every subcommand runs under either interpreter.

Their first call is the prefill with one draft at E = 1 merged into it; our round 0 is the prefill, and with
`prefill_draft` (method=del's default) the plain round after it when that draft was accepted: compare pairs their
call 0 with our rounds before the first planned one, and every later round by its start offset.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import Counter
from pathlib import Path

AUTHORS_COMMIT = "0365a81"  # the commit whose self_speculation/ files docs/design.md §3.5 cites


# ---- export (our .venv) ------------------------------------------------------------------------------------------
def export(model_dir: Path, out: Path) -> None:
    """model_dir (an HF Llama directory: config.json, model.safetensors) → out, loadable by transformers 4.45 in
    float32. The testbed stores float16 weights and computes in float32: the upcast is exact."""
    import torch
    from safetensors.torch import load_file, save_file

    config = json.loads((model_dir / "config.json").read_text())
    rope = config.pop("rope_parameters", None) or {}
    config.setdefault("rope_theta", rope.get("rope_theta", 10000.0))
    config.pop("dtype", None)
    config["torch_dtype"] = "float32"
    tensors = {k: v.to(torch.float32).contiguous() for k, v in load_file(model_dir / "model.safetensors").items()}
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    print(f"exported {model_dir} → {out} ({len(tensors)} tensors, float32)")


# ---- drive (their python) ----------------------------------------------------------------------------------------
def prompts_of(run_dir: Path) -> list[dict]:
    """Our run's prompts as the model saw them: [{sample_id, prompt_ids}] in the run's order."""
    lines = (run_dir / "samples.jsonl").read_text().splitlines()
    return [{"sample_id": r["sample_id"], "prompt_ids": r["prompt_ids"]} for r in map(json.loads, lines)]


def drive(authors: Path, python: str, model_dir: Path, run_dir: Path, out: Path, max_new_tokens: int,
          eos: list[int]) -> None:
    """Their DEL generator over our run's prompt ids, in their python with their checkout importable (PYTHONPATH):
    this file's `theirs` subcommand in a subprocess. The JSONL's first line names the checkout's commit."""
    import os
    import subprocess

    commit = subprocess.run(["git", "-C", str(authors), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    if not commit.startswith(AUTHORS_COMMIT):
        print(f"note: {authors} is at {commit.strip() or 'an unknown commit'}, not {AUTHORS_COMMIT} "
              "(docs/design.md §3.5 cites that one)", file=sys.stderr)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(authors.resolve()), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([python, __file__, "theirs", "--model", str(model_dir), "--run", str(run_dir), "--out", str(out),
                    "--max-new-tokens", str(max_new_tokens), "--commit", commit.strip(), "--eos", *map(str, eos)],
                   env=env, check=True)


def theirs(model_dir: Path, run_dir: Path, out: Path, max_new_tokens: int, eos: list[int], commit: str) -> None:
    """drive's subprocess: their modules on the path. One JSONL line a prompt (their rounds as `calls`)."""
    import torch
    import transformers
    from self_speculation.DEL_speculation_generator import DELSpeculativeGenerationStrategy
    from self_speculation.generator_base import GenerationConfig

    class Recorded(DELSpeculativeGenerationStrategy):
        """Their strategy, each call's decision and outcome recorded around their own single_step_speculation."""

        def single_step_speculation(self, **kwargs):
            start = len(kwargs["output_ids"])  # their output list is extended in place
            layer = kwargs["exit_layer"]
            conf = self.DEL.average_confidence[layer - 1]
            call = {"offset": start, "exit_layer": layer, "prefill": self.DEL.is_prefill_stage,
                    "tau": _finite(float((conf[0] + conf[1]) / 2)), "gamma_tpl": int(self.DEL.current_gamma)}
            result = super().single_step_speculation(**kwargs)
            _, output_ids, _, accepted, drafted = result
            call.update(drafted=int(drafted), accepted=int(accepted), emitted=len(output_ids) - start)
            self.calls.append(call)
            return result

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    model.eval()
    config = GenerationConfig(max_steps=max_new_tokens, sample=False, generation_strategy="DEL")
    with out.open("w") as f:
        f.write(json.dumps({"authors_commit": commit, "transformers": transformers.__version__,
                            "torch": torch.__version__, "run": str(run_dir), "max_new_tokens": max_new_tokens}) + "\n")
        for prompt in prompts_of(run_dir):
            strategy = Recorded()
            strategy.calls = []
            with torch.inference_mode():
                result = strategy.generate_token_ids(model=model, input_ids=prompt["prompt_ids"], eos_token_ids=eos,
                                                     generation_config=config)
            f.write(json.dumps({"sample_id": prompt["sample_id"], "output_ids": result.predicted_tokens,
                                "tokens_per_layer": result.tokens_per_layer, "calls": strategy.calls,
                                "num_layers": len(model.model.layers)}) + "\n")
            print(f"{prompt['sample_id']}: {len(strategy.calls)} calls, {len(result.predicted_tokens)} tokens")


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None  # their τ is NaN while a layer has no match or no mismatch yet


# ---- compare (any python) ----------------------------------------------------------------------------------------
def read_theirs(path: Path) -> dict[str, dict]:
    """drive's JSONL → {sample_id: record} (its first line, which names the checkout, left out)."""
    return {r["sample_id"]: r for r in map(json.loads, path.read_text().splitlines()) if "sample_id" in r}


def read_ours(run_dir: Path) -> dict[str, dict]:
    """Our run → {sample_id: {output_ids, rounds (in order), num_layers}} (first repeat, single-turn samples)."""
    samples = {}
    for r in map(json.loads, (run_dir / "samples.jsonl").read_text().splitlines()):
        if r.get("repeat", 0) == 0:
            samples[r["sample_id"]] = {"output_ids": r["output_ids"], "num_layers": r["num_layers"], "rounds": []}
    for r in map(json.loads, (run_dir / "rounds.jsonl").read_text().splitlines()):
        if r.get("repeat", 0) == 0 and r["sample_id"] in samples:
            samples[r["sample_id"]]["rounds"].append(r)
    for s in samples.values():
        s["rounds"].sort(key=lambda r: r["round"])
    return samples


def with_offsets(rounds: list[dict]) -> list[dict]:
    """Each round with the output offset it starts at (the tokens emitted before it)."""
    offset, out = 0, []
    for r in rounds:
        out.append({**r, "offset": offset})
        offset += r["emitted"]
    return out


def first_planned(rounds: list[dict]) -> int:
    """Index of our first round planned by the controller: after the prefill (round 0) and the plain round that
    emits the token after an accepted prefill draft (its trace: `prefill_draft`)."""
    i = 1
    while i < len(rounds) and rounds[i].get("prefill_draft"):
        i += 1
    return i


def align(ours: list[dict], theirs: list[dict]) -> list[tuple[dict | None, dict | None]]:
    """Pairs (our round, their call): their call 0 (the prefill with one draft) against our rounds before the first
    planned one, taken together (`first`: their emitted tokens and loaded layers summed), then every later round by
    the output offset it starts at. A round with none of the other side at its offset pairs with None."""
    ours, theirs = with_offsets(ours), with_offsets(theirs)
    start = first_planned(ours)
    head = {"first": True, "offset": 0, "emitted": sum(r["emitted"] for r in ours[:start]),
            "loaded_layers": sum(r["loaded_layers"] for r in ours[:start])}
    pairs = [(head, {**theirs[0], "first": True} if theirs else None)]
    mine = {r["offset"]: r for r in ours[start:]}
    other = {r["offset"]: r for r in theirs[1:]}
    pairs += [(mine.get(offset), other.get(offset)) for offset in sorted(set(mine) | set(other))]
    return pairs


def kind_of(our: dict | None, their: dict | None, max_new_tokens: int) -> str:
    """How a pair of rounds compares: "equal", or what differs. The first pair is equal when both emitted as many
    tokens (their draft accepted ⇔ our plain round after the prefill); later ones when (E, d) are equal."""
    if our is None or their is None:
        return "out of step (no round of " + ("ours" if our is None else "theirs") + " at this offset)"
    if our.get("first"):
        return "equal" if our["emitted"] == their["emitted"] else "first round: the tokens it emits differ"
    exit_layer = our["exit_layer"] if our["drafted"] else None
    if (exit_layer, our["drafted"]) == (their["exit_layer"], their["drafted"]):
        return "equal"
    if our["offset"] + our["budget"] + 1 >= max_new_tokens and their["drafted"] > our["budget"]:
        return "our budget capped at the tokens left (theirs runs past max_new_tokens)"
    if exit_layer is None:  # the plan's E (trace chosen_exit_layer): None = TPL's γ = 0
        if our.get("chosen_exit_layer") is None:
            return "we decode plainly (TPL's γ = 0), they draft"
        return "we draft nothing (the first candidate fell below τ and was dropped), they keep it"
    return "exit layer differs" if exit_layer != their["exit_layer"] else "drafted differs"


def compare(theirs_path: Path, run_dir: Path, max_new_tokens: int, vanilla: Path | None = None) -> dict:
    """Per sample: the pairs and how many are equal, each side's eTPL (tokens ÷ the layers its rounds loaded, d·E + L
    a round, their call 0 E + L) and α (accepted ÷ drafted), its first round's share and the tokens their code
    emitted past max_new_tokens; overall the pairs by kind. With `vanilla` (a run of ours), both sides' outputs
    against its."""
    theirs, ours = read_theirs(theirs_path), read_ours(run_dir)
    plain = read_ours(vanilla) if vanilla else {}
    rows, kinds = [], Counter()
    for sid, o in ours.items():
        if sid not in theirs:
            continue
        t, L = theirs[sid], o["num_layers"]
        pairs = align(o["rounds"], t["calls"])
        got = [kind_of(a, b, max_new_tokens) for a, b in pairs]
        kinds.update(got)
        their_layers = [c["exit_layer"] * c["drafted"] + L for c in t["calls"]]
        their_tokens = sum(c["emitted"] for c in t["calls"])
        reference = plain[sid]["output_ids"] if sid in plain else o["output_ids"]
        rows.append({
            "sample_id": sid, "pairs": len(pairs), "equal": got.count("equal"),
            "their_rounds": len(t["calls"]), "our_rounds": len(o["rounds"]),
            "their_tokens": their_tokens, "our_tokens": len(o["output_ids"]),
            "past_max_new_tokens": max(their_tokens - max_new_tokens, 0),
            "first_round": {"their_tokens": t["calls"][0]["emitted"], "their_layers": their_layers[0],
                            "our_tokens": pairs[0][0]["emitted"], "our_layers": pairs[0][0]["loaded_layers"]},
            "theirs_equal_reference": t["output_ids"][: len(reference)] == reference,
            "ours_equal_reference": o["output_ids"] == reference,
            "their_etpl": their_tokens / sum(their_layers),
            "our_etpl": len(o["output_ids"]) / sum(r["loaded_layers"] for r in o["rounds"]),
            "their_alpha": _ratio(sum(c["accepted"] for c in t["calls"]), sum(c["drafted"] for c in t["calls"])),
            "our_alpha": _ratio(sum(r["accepted"] for r in o["rounds"]), sum(r["drafted"] for r in o["rounds"])),
        })
    return {"rows": rows, "kinds": dict(kinds), "reference": "vanilla" if vanilla else "ours"}


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0


def print_table(result: dict) -> None:
    rows, ref = result["rows"], result["reference"]
    if not rows:
        print("no sample in common")
        return
    print(f"| sample | pairs | (E, d) equal | rounds theirs / ours | tokens theirs / ours | = {ref}: theirs / ours | "
          "first round tokens, layers: theirs / ours | eTPL theirs / ours | α theirs / ours |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        f = r["first_round"]
        print(f"| {r['sample_id']} | {r['pairs']} | {r['equal']} ({r['equal'] / r['pairs']:.1%}) | {r['their_rounds']}"
              f" / {r['our_rounds']} | {r['their_tokens']} / {r['our_tokens']} | {_yes(r['theirs_equal_reference'])} /"
              f" {_yes(r['ours_equal_reference'])} | {f['their_tokens']}, {f['their_layers']:g} / {f['our_tokens']}, "
              f"{f['our_layers']:g} | {r['their_etpl']:.4f} / {r['our_etpl']:.4f} | {r['their_alpha']:.3f} / "
              f"{r['our_alpha']:.3f} |")
    n, pairs, equal = len(rows), sum(r["pairs"] for r in rows), sum(r["equal"] for r in rows)
    mean = lambda key: sum(r[key] for r in rows) / n  # noqa: E731
    print(f"| all ({n}) | {pairs} | {equal} ({equal / pairs:.1%}) | {sum(r['their_rounds'] for r in rows)} / "
          f"{sum(r['our_rounds'] for r in rows)} | {sum(r['their_tokens'] for r in rows)} / "
          f"{sum(r['our_tokens'] for r in rows)} | {sum(r['theirs_equal_reference'] for r in rows)}/{n} / "
          f"{sum(r['ours_equal_reference'] for r in rows)}/{n} | | {mean('their_etpl'):.4f} / {mean('our_etpl'):.4f}"
          f" | {mean('their_alpha'):.3f} / {mean('our_alpha'):.3f} |")
    print(f"\npairs by kind ({pairs}); their tokens past max_new_tokens: "
          f"{sum(r['past_max_new_tokens'] for r in rows)} (eTPL: mean over prompts; α: accepted ÷ drafted per prompt,"
          " then the mean)")
    for kind, count in sorted(result["kinds"].items(), key=lambda kv: -kv[1]):
        print(f"  {count:5d}  {kind}")


def _yes(flag: bool) -> str:
    return "yes" if flag else "NO"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("export", help="the testbed as a float32 HF directory for transformers 4.45")
    p.add_argument("--model", type=Path, default=Path("results/testbed"))
    p.add_argument("--out", type=Path, required=True)
    p = sub.add_parser("drive", help="their DEL generator over one of our runs' prompts, in their python")
    p.add_argument("--authors", type=Path, required=True, help=f"a checkout of hoenza/DEL at {AUTHORS_COMMIT}")
    p.add_argument("--python", required=True, help="a python with torch, transformers==4.45.2, colorama, "
                   "matplotlib, lxml")
    p.add_argument("--model", type=Path, required=True, help="export's directory")
    p.add_argument("--run", type=Path, required=True, help="one of our runs (its samples.jsonl's prompt ids)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--eos", type=int, nargs="+", default=[0], help="EOS token ids (the testbed's: 0)")
    p = sub.add_parser("theirs", help="drive's subprocess (their modules importable)")
    for name in ("--model", "--run", "--out"):
        p.add_argument(name, type=Path, required=True)
    p.add_argument("--max-new-tokens", type=int, required=True)
    p.add_argument("--eos", type=int, nargs="+", required=True)
    p.add_argument("--commit", default="")
    p = sub.add_parser("compare", help="their JSONL against our run's rounds.jsonl")
    p.add_argument("--theirs", type=Path, required=True)
    p.add_argument("--run", type=Path, required=True)
    p.add_argument("--vanilla", type=Path, help="a Vanilla run of ours on the same prompts: both outputs against it")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args(argv)
    if args.command == "export":
        export(args.model, args.out)
    elif args.command == "drive":
        drive(args.authors, args.python, args.model, args.run, args.out, args.max_new_tokens, args.eos)
    elif args.command == "theirs":
        theirs(args.model, args.run, args.out, args.max_new_tokens, args.eos, args.commit)
    else:
        result = compare(args.theirs, args.run, args.max_new_tokens, args.vanilla)
        print_table(result)
        if args.json:
            args.json.write_text(json.dumps(result, indent=1) + "\n")

if __name__ == "__main__":
    main()
