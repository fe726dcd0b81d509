"""Synthetic run records for the report tests, written exactly as del_bench.runner writes them.

`write_records(root)` writes ~60 run directories (summary.json, samples.jsonl, rounds.jsonl, run_config.json)
from the compact spec below: a deterministic toy simulation of each method's rounds (acceptance drawn from a
seeded RNG, times from a per-layer cost), so every number in the tables and figures follows from the
records the way real ones do. No torch, no model: it runs in milliseconds and gives the same bytes on every
machine (only +, ×, ÷ on floats and Python's seeded `random`).

What the spec covers, by design:
- llama2-7b (a paper model, so the paper's rows appear beside ours): Vanilla, LS(E7-γ6), DEL on six tasks;
  FS(E7-γ6), DV(E7) on Table 1's four; LS on WMT14 without a Vanilla partner ("no vanilla"); DEL on
  CNN/DM-Sum at ω = 0.5, 0.9, 1 (Table 6) and a second seed at ω = 0.95 (mean ± std); peak memory on all
  runs but DV (Table 5 "n/a").
- llama2-7b, Table 4's tasks (HumanEval, CNN/DM-LM): the layer-skipping methods SWIFT, CLaSp and KnapSpec (no exit
  layer: a draft runs the full depth less S/2 layers), so Table 4 shows their gains over Vanilla.
- codellama-7b: Table 2 — humaneval (greedy) and humaneval_pass10 (sampled, 2 samples per problem).
- smollm2-135m (no memory fields, as a runner without them): the workflow of Figure 1 — `calibrate` grid
  points (sample_set=calibration, own prompts, 256 tokens): Vanilla + LS E ∈ {12, 20} × γ ∈ {2, 4} on three
  tasks (Figures 1a, 1b); evaluation runs of the calibrated configs on the tasks (one left out: Figure 1a
  falls back to its grid point); DEL and its ablations on HumanEval (Figures 3a, 3b, 4a–4c; the DEL run
  records conf_matched / conf_mismatched, so Figure 4b draws its band); DEL with E fixed at 20 and
  d_max 2 / 4 without draft-exiting on CNN/DM-LM (Figure 3b at a fixed E, as the paper's).
- DEL's runs are as its authors' code runs it (method=del's settings) but for one Algorithm 1 run per Table 1
  task (DEL (Alg. 1), beside DEL).
- experiment membership (run_key.experiments): the ω sweep belongs to table6 and the d_max sweep to fig3b, so
  neither may appear in Tables 1–3; every other run is ad hoc (older records without run_key, read through the
  adapter). DEL-E on SmolLM2 HumanEval decodes one output that differs from Vanilla's (the lossless check).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from del_bench.records import run_key_of

MODELS = {  # layers, ms per decoder layer per token, ms per LM-head row, weight bytes
    "llama2-7b": dict(L=32, layer_ms=0.9, head_ms=0.4, model_bytes=13_476_839_424),
    "codellama-7b": dict(L=32, layer_ms=0.9, head_ms=0.4, model_bytes=13_477_093_376),
    "smollm2-135m": dict(L=30, layer_ms=1.4, head_ms=6.0, model_bytes=None),
}
TASK_ALPHA = {  # α(E) = a · E / (E + k): how well layer E's drafts agree with the full model, per task
    "aqua_rat": (0.95, 1.5), "cnndm_lm": (0.93, 1.2), "cnndm_sum": (0.97, 1.8), "xsum": (0.94, 1.6),
    "gsm8k": (0.90, 1.5), "humaneval": (0.96, 1.4), "humaneval_pass10": (0.94, 1.6), "wmt14_de_en": (0.93, 1.4),
}
SMOL_ALPHA = {  # SmolLM2's grid: α per exit layer, chosen so that each task has a different best (E, γ)
    "humaneval": {12: 0.3, 20: 0.9}, "cnndm_lm": {12: 0.75, 20: 0.85}, "xsum": {12: 0.92, 20: 0.96}}
TASK_MEMORY = {"aqua_rat": 0.57, "cnndm_lm": 0.25, "cnndm_sum": 0.72, "xsum": 0.27, "gsm8k": 0.81,
               "humaneval": 0.19, "humaneval_pass10": 0.19, "wmt14_de_en": 0.22}  # GB of KV + activations
METHOD_MEMORY = {"vanilla": 0.0, "ls": 0.006, "fs": 0.007, "dv": 0.008, "del": 0.012, "swift": 0.002, "clasp": 0.003,
                 "knapspec": 0.004}  # × weight bytes
TABLE1 = ["aqua_rat", "cnndm_lm", "cnndm_sum", "xsum"]
SKIPPED = {"swift": 27, "clasp": 16, "knapspec": 22}  # sublayers a layer-skipping draft skips (of 2L)
SKIP_ALPHA = {"swift": 0.8, "clasp": 0.75, "knapspec": 0.85}  # their drafts' agreement with the full model
SIX = TABLE1 + ["gsm8k", "humaneval"]


def spec() -> list[dict]:
    """One dict per run: model, task, method, hyperparameters and record options."""
    runs = []

    def add(model, task, method, seed=42, memory=None, calibration=False, experiments=(), differs=(), alg1=False,
            **hp):
        if method.startswith("del") and not alg1:  # DEL as its authors' code runs it (configs/method/del.yaml)
            hp = {"keep_stopped_draft": True, "prefill_draft": True, "prefill_window": 33, **hp}
        runs.append(dict(model=model, task=task, method=method, seed=seed, hp=hp, calibration=calibration,
                         memory=memory if memory is not None else model != "smollm2-135m" and method != "dv",
                         experiments=experiments, differs=differs))

    for task in SIX:
        add("llama2-7b", task, "vanilla")
        add("llama2-7b", task, "ls", exit_layer=7, gamma=6)
        add("llama2-7b", task, "del", omega=0.95)
    for task in TABLE1:
        add("llama2-7b", task, "del", omega=0.95, alg1=True)  # DEL (Alg. 1), beside DEL
        add("llama2-7b", task, "fs", exit_layer=7, gamma=6)
        add("llama2-7b", task, "dv", exit_layer=7)
    add("llama2-7b", "wmt14_de_en", "ls", exit_layer=7, gamma=6)
    for task in ("humaneval", "cnndm_lm"):
        for method, skipped in SKIPPED.items():
            add("llama2-7b", task, method, skipped=skipped)
    add("llama2-7b", "cnndm_sum", "del", seed=43, omega=0.95)
    for omega in (0.5, 0.9, 1.0):
        add("llama2-7b", "cnndm_sum", "del", omega=omega, experiments=("table6",))
    for task in ("humaneval", "humaneval_pass10"):
        add("codellama-7b", task, "vanilla")
        add("codellama-7b", task, "ls", exit_layer=7, gamma=6)
        add("codellama-7b", task, "del", omega=0.95)
    for task in ("humaneval", "cnndm_lm", "xsum"):
        add("smollm2-135m", task, "vanilla", calibration=True)
        for e in (12, 20):
            for g in (2, 4):
                add("smollm2-135m", task, "ls", calibration=True, exit_layer=e, gamma=g)
        add("smollm2-135m", task, "vanilla")
        add("smollm2-135m", task, "ls", exit_layer=12, gamma=2)  # CNN/DM-LM's best grid point
        add("smollm2-135m", task, "ls", exit_layer=20, gamma=4)  # HumanEval's
        if task != "xsum":  # XSUM's best is left unevaluated on XSUM itself: Figure 1a uses its grid point
            add("smollm2-135m", task, "ls", exit_layer=12, gamma=4)
    add("smollm2-135m", "humaneval", "del", omega=0.95, band=True)
    add("smollm2-135m", "humaneval", "del_e", omega=0.95, differs=("s1",))
    add("smollm2-135m", "humaneval", "del_gamma", omega=0.95, exit_layer=20)
    add("smollm2-135m", "humaneval", "del_e_lim", omega=0.95)
    for d_max in (2, 4):
        add("smollm2-135m", "cnndm_lm", "del", omega=0.95, exit_layer=20, d_max=d_max, experiments=("fig3b",))
    return runs


def _tag(method: str, hp: dict) -> str:
    if method in ("ls", "fs"):
        return f"{method}-E{hp['exit_layer']}-g{hp['gamma']}"
    if method == "dv":
        return f"dv-E{hp['exit_layer']}"
    if method in SKIPPED:
        return f"{method}-s{hp['skipped']}"
    if method.startswith("del"):
        fixed = f"-E{hp['exit_layer']}" if hp.get("exit_layer") else ""
        fixed += f"-d{hp['d_max']}-fixed" if hp.get("d_max") else ""
        reading = "" if hp.get("prefill_draft") else "-alg1"
        return f"{method}{fixed}-w{hp['omega']}-layers-vNone{reading}"
    return method


def _alpha(model: str, task: str, exit_layer: int) -> float:
    if model == "smollm2-135m":
        grid = SMOL_ALPHA[task]
        return grid.get(exit_layer, grid[12] if exit_layer < 16 else grid[20])
    a, k = TASK_ALPHA[task]
    return a * exit_layer / (exit_layer + k)


def _simulate(run: dict, sample_id: str, repeat: int, n_tokens: int) -> list[dict]:
    """Rounds of one output: round 0 = prefill, then draft/verify rounds until n_tokens are emitted."""
    m, method, hp = MODELS[run["model"]], run["method"], run["hp"]
    L, layer, head = m["L"], m["layer_ms"] / 1000, m["head_ms"] / 1000
    rng = random.Random(f"{run['model']}|{run['task']}|{_tag(method, hp)}|{run['seed']}|{sample_id}|{repeat}")
    is_del = method.startswith("del")
    rounds = [{"round": 0, "exit_layer": None, "budget": 0, "drafted": 0, "accepted": 0, "emitted": 1,
               "loaded_layers": L, "head_calls": 1, "draft_s": 0.0, "verify_s": 3 * L * layer + head,
               "policy_s": 0.002 if is_del else 2e-6}]
    emitted, gamma, tau = 1, hp.get("gamma", 0), 0.45
    while emitted < n_tokens:
        left = n_tokens - emitted
        trace = {}
        if method == "vanilla":
            E, budget, drafted = None, 0, 0
        elif method in ("ls", "fs"):
            E, budget = hp["exit_layer"], gamma
            drafted = min(budget, left - 1)
        elif method == "dv":
            E, budget = hp["exit_layer"], 18
            drafted = min(1 + int(rng.random() * 6), left - 1)
        elif method in SKIPPED:  # full depth with sublayers skipped: no exit layer, S/2 layers fewer per draft
            E, budget = None, 4
            drafted = min(1 + int(rng.random() * 4), left - 1)
        else:  # DEL family: E from TPL (here: a seeded walk), drafting stopped by τ
            lo = 4 if method == "del_e_lim" else 1
            E = hp.get("exit_layer") or max(lo, min(L - 1, (6 if L == 32 else 18) + int(rng.random() * 5) - 2))
            budget = hp.get("d_max", 18)
            drafted = min(budget if hp.get("d_max") else 1 + int(rng.random() * 8), left - 1)
            tau = min(0.8, max(0.2, tau + (rng.random() - 0.5) * 0.06))
            spread = 0.25 + rng.random() * 0.1
            trace = {"gamma_tpl": 1 + int(rng.random() * 6), "tau": round(tau, 6),
                     "alpha_exit": round(_alpha(run["model"], run["task"], E), 6), "chosen_exit_layer": E}
            if hp.get("band"):
                trace.update(conf_matched=round(tau + spread, 6), conf_mismatched=round(tau - spread, 6))
        skipping = method in SKIPPED
        if (E is None and not skipping) or drafted <= 0:
            E, drafted = None, 0
        alpha = SKIP_ALPHA[method] if skipping else _alpha(run["model"], run["task"], E) if E else 0.0
        draft_layers = L - hp["skipped"] / 2 if skipping else (E or 0)
        accepted = 0
        while accepted < drafted and rng.random() < alpha:
            accepted += 1
        if method == "fs":
            gamma = gamma + 1 if accepted == drafted else max(1, gamma - 1)
        out = accepted + 1
        rounds.append({
            "round": len(rounds), "exit_layer": E, "budget": min(budget, left - 1), "drafted": drafted,
            "accepted": accepted, "emitted": out, "loaded_layers": _whole(drafted * draft_layers + L),
            "head_calls": drafted + accepted + 1,
            "draft_s": drafted * (draft_layers * layer + head),
            "verify_s": (L - (E or 0)) * layer + (E or 0) * layer + 0.05 * layer * drafted + head * (accepted + 1),
            "policy_s": (0.0004 + 0.00008 * (drafted + 1)) if is_del else 2e-6,
            **trace,
        })
        emitted += out
    return rounds


def _whole(layers: float):
    """Loaded layers as the engine writes them: an int where whole (a skipped sublayer counts ½)."""
    return int(layers) if float(layers).is_integer() else layers


def _config(run: dict, out_dir: str) -> dict:
    m, method, hp = MODELS[run["model"]], run["method"], run["hp"]
    task = {"name": run["task"], "n": None, "samples_per_prompt": 2 if run["task"] == "humaneval_pass10" else 1}
    if run["task"] == "humaneval_pass10":  # the task fixes its decoding (the runner merges it over `generation`)
        task["generation"] = {"do_sample": True, "temperature": 0.6, "top_p": 0.95}
    method_cfg = {"name": method, "tag": _tag(method, hp)}
    if method in ("ls", "fs", "dv"):
        method_cfg.update(exit_layer=hp["exit_layer"], **({"gamma": hp["gamma"]} if "gamma" in hp else {}))
    if method.startswith("del"):
        method_cfg.update(omega=hp["omega"], d_max=hp.get("d_max", 18), exit_layer=hp.get("exit_layer"),
                          dynamic_draft_exit=not hp.get("d_max"),
                          min_exit_layer=4 if method == "del_e_lim" else 1, cost_model="layers", shadow_vocab=None,
                          **{k: hp[k] for k in ("keep_stopped_draft", "prefill_draft", "prefill_window") if k in hp})
    calibration = {"sample_set": "calibration", "calibration": {"samples": 2, "eval_limit": 2}} \
        if run["calibration"] else {}
    return {"limit": 2, "max_new_tokens": 256 if run["calibration"] else 512, "seed": run["seed"], "threads": 2,
            "warmup_tokens": 16, **calibration,
            "generation": {"do_sample": False, "temperature": 1.0, "top_p": 1.0}, "out_dir": out_dir,
            "model": {"name": run["model"], "num_layers": m["L"]}, "task": task, "method": method_cfg,
            "logger": {"name": "none"}}


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def write_run(root: Path, run: dict) -> Path:
    m = MODELS[run["model"]]
    method, hp = run["method"], run["hp"]
    tag = _tag(method, hp)
    rel = (f"calibration/{run['model']}/{run['task']}/{tag}/greedy-max256-seed{run['seed']}" if run["calibration"]
           else f"{run['model']}/{run['task']}/{tag}/greedy-max512-seed{run['seed']}")
    out = root / rel
    out.mkdir(parents=True, exist_ok=True)
    config = _config(run, f"results/runs/{rel}")
    repeats = config["task"]["samples_per_prompt"]
    lengths = {"s0": 150, "s1": 96} if run["model"] == "smollm2-135m" else {"s0": 80, "s1": 56}
    if run["calibration"]:  # calibration samples are drawn apart from the evaluation selection
        lengths = {"c0": 150, "c1": 96}
    samples, rounds_out = [], []
    for sid, n_tokens in lengths.items():
        for repeat in range(repeats):
            rounds = _simulate(run, sid, repeat, n_tokens)
            wall = sum(r["draft_s"] + r["verify_s"] + r["policy_s"] for r in rounds) + 0.0003
            loaded = sum(r["loaded_layers"] for r in rounds)
            drafted, accepted = sum(r["drafted"] for r in rounds), sum(r["accepted"] for r in rounds)
            passed = (len(samples) + run["seed"]) % 2
            rouge = 0.08 + 0.01 * ((n_tokens + repeat) % 5)
            samples.append({
                "sample_id": sid, "repeat": repeat, "task_version": "1", "prompt": f"prompt {sid}",
                "prompt_ids": [1, 2, 3], "output_ids": [8 if sid in run["differs"] else 7] * n_tokens,
                "output_text": "x" * n_tokens,
                "generated_tokens": n_tokens, "num_layers": m["L"], "loaded_layers": loaded,
                "head_calls": sum(r["head_calls"] for r in rounds), "rounds": len(rounds), "wall_s": wall,
                "tokens_per_s": n_tokens / wall, "etpl": n_tokens / loaded, "drafted": drafted,
                "accepted": accepted, "scores": {"passed": passed, "rouge2": rouge},
            })
            rounds_out += [{"sample_id": sid, "repeat": repeat, **r} for r in rounds]
    n = len(samples)
    timed = sum(r["draft_s"] + r["verify_s"] + r["policy_s"] for r in rounds_out)
    drafted, accepted = sum(s["drafted"] for s in samples), sum(s["accepted"] for s in samples)
    summary = {
        "method": method, "method_tag": tag, "model": run["model"], "task": run["task"], "task_version": "1",
        "decoding": "greedy",  # as the runner writes it: from the run's generation settings, not the task's
        "n_samples": n,
        "tokens_per_s": sum(s["tokens_per_s"] for s in samples) / n,
        "etpl": sum(s["etpl"] for s in samples) / n,
        "acceptance_rate": accepted / drafted if drafted else None,
        "generated_tokens": sum(s["generated_tokens"] for s in samples),
        "loaded_layers": sum(s["loaded_layers"] for s in samples),
        "head_calls": sum(s["head_calls"] for s in samples), "drafted": drafted, "accepted": accepted,
        "wall_s": sum(s["wall_s"] for s in samples),
        "time_split": {p: sum(r[f"{p}_s"] for r in rounds_out) / timed for p in ("draft", "verify", "policy")},
        "accepted_per_round": {},
        "quality": {"rouge2": sum(s["scores"]["rouge2"] for s in samples) / n,
                    **({"pass@1": sum(s["scores"]["passed"] for s in samples) / n}
                       if run["task"].startswith("humaneval") else {})},
        "config": config,
        "provenance": {"git_commit": None, "git_dirty": False, "packages": {}, "python": "3.11.0",
                       "device": "cpu", "cpu": "x86_64", "torch_threads": 2},
        "measured_costs": None,
        "selection": ({"sample_set": "calibration", "count": 2, "eval_limit": 2, "seed": run["seed"]}
                      if run["calibration"] else {"sample_set": "eval", "limit": 2, "seed": run["seed"]}),
    }
    if run["memory"]:
        extra = TASK_MEMORY[run["task"]] * 1e9 + m["model_bytes"] * METHOD_MEMORY[method.split("_")[0]]
        summary["peak_memory_bytes"] = int(m["model_bytes"] + extra + 1e6 * (run["seed"] - 42))
        summary["memory_measure"] = "peak RSS growth (synthetic)"
        summary["model_bytes"] = m["model_bytes"]
    if run["experiments"]:  # as the runner writes it; the other runs exercise the adapter for older records
        key = run_key_of(summary, samples)
        for name in run["experiments"]:
            key = key.with_experiment(name)
        summary["run_key"] = key.as_dict()
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "run_config.json").write_text(json.dumps(config, indent=2) + "\n")
    _write_jsonl(out / "samples.jsonl", samples)
    _write_jsonl(out / "rounds.jsonl", rounds_out)
    return out


def write_records(root: str | Path) -> Path:
    """Write every run of spec() under root/runs; returns that directory."""
    runs = Path(root) / "runs"
    for run in spec():
        write_run(runs, run)
    return runs
