"""Eager vs graph-captured decoding on a GPU: a synthetic early-exit model or a random one at a real model's shape (
Llama-2-7B, Llama-3-8B, …) or the testbed, ours vs HF.

Rows, every one a run with records, interleaved prompt by prompt after the runner's untimed warm-up, clocks read
after a device synchronisation, by path:
- eager (`compile=off`: our layer loop, fused where it builds): our Vanilla, LS(E, γ) and DEL, and transformers'
  `generate` and `generate(assistant_early_exit=E, num_assistant_tokens=γ)` († peers, on the same weights:
  LayerStack re-points HF's modules at its own storage, one copy);
- each of `--captured` (default `graphs,on`): the same methods of ours on the graph-captured steps
  (engine/compiled.py) — `graphs`: the eager kernels captured as CUDA graphs; `on` (fused graphs): inductor's fused
  kernels captured; `auto`: what a run chooses. A compile that is refused (CompileUnavailable, or any error of such
  a row) ends that row only: it is listed with the reason, the others go on.

The model: `--model random` (default) a Llama of `--shape` (llama2-7b, llama2-13b, llama3-8b; the matrix sizes,
any of them overridden by --layers --hidden …) with random weights made on the device in the dtype (no host copy;
the same seed on the same device type gives the same weights), prompts of random bytes, no EOS (every row runs to
the end); its records name it model=tiny-random at that shape. A synthetic model (`--model synthetic-llama2-7b`,
models/synthetic.py: a real shape whose early exits agree as often as its `model.agreement`, so the methods draft
as on a trained model) gets the same random prompts. Or a model config (`--model testbed`: the LayerSkip-trained
testbed, its held-out code prompts; `--task` another task).

Per row, from its records: tok/s (mean over prompts); per-prompt speed (tok/s prompt by prompt in decode order; the
first timed prompt ÷ the median of the rest: far below 1, the warm-up left decoding short of steady state); roofline
(tok/s ÷ the memory-bandwidth roofline of one-token decoding: bandwidth ÷ the bytes a token streams — every layer's
weights, the final norm and LM head, the KV cache at the samples' mean context; a speculative row can exceed 1); HBM
(our rows: the bytes our loop streamed ÷ seconds ÷ bandwidth: loaded layers × a layer's bytes + (rounds + drafted) ×
the head's); each of the two also as a fraction of the bandwidth measured in the same run (/probe, HBM/probe: a GEMV
over a weight larger than the caches, in the model's dtype, timed with CUDA events after a warm-up — what one-token
decoding can stream at best here, beside the data sheet's figure); eTPL, α; speedup over its path's Vanilla; pred.
(the memory-bound prediction: its tokens per streamed byte ÷ its path's Vanilla's) and meas/pred; host reads a round;
peak memory; "= generate" and "= Vanilla" (the Vanilla of the row's own path): outputs equal, first departing at a
near-tie of the reference's logits (allowed in half precision: del_bench/numerics.py, the reference's recorded
top2_gap_ulps) or really departing. Bandwidth: --bandwidth GB/s, else the device's data-sheet figure, else the
probe's. And, once, the kernel launches of one decoder layer at a decode position, eager and fused
(`launches_per_layer`). Random weights rarely agree across depths: on them the rows measure mechanics (a round's cost,
the roofline, memory); a synthetic model's rows measure what each method's drafting pays at a real layer's cost.
"""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path

import torch

from del_bench.bench import harness as h
from del_bench.engine.path_choice import stack_of
from del_bench.methods.peers import peer_method
from del_bench.models.layer_stack import LayerStack
from del_bench.models.loading import DTYPES, AnyIdTokenizer, Loaded
from del_bench.models.synthetic import SHAPES, llama_config, random_llama, random_text
from del_bench.records import is_peer, read_jsonl, throughput

NOMINAL_GBPS = (  # (substring of torch.cuda.get_device_name, GB/s): HBM bandwidth from the vendors' data sheets
    ("H200", 4800.0), ("H100 PCIe", 2000.0), ("H100 NVL", 3900.0), ("H100", 3350.0),  # first match wins
    ("A100-SXM4-80GB", 2039.0), ("A100 80GB PCIe", 1935.0), ("A100", 1555.0),
    ("L40S", 864.0), ("A10G", 600.0), ("A10", 600.0), ("L4", 300.0), ("V100", 900.0),
)
COLUMNS = ["row", "tok/s", ("B", "batch_size", "d", 2), ("batch tok/s", "throughput", ".1f", 11),
           ("×B=1", "scaling", "x", 6), ("1st/rest", "first_over_rest", ".2f", 8), ("roofline", "roofline_x", ".3g", 8),
           ("/probe", "roofline_probe_x", ".3g", 6), ("HBM", "hbm_fraction", ".2f", 5),
           ("HBM/probe", "hbm_probe_fraction", ".2f", 9), "eTPL", "α", ("speedup", "speedup", ".2f", 7),
           ("acc/token", "token_acceptance", ".2f", 9), ("pred.", "bytes_predicted_speedup", ".2f", 5),
           ("meas/pred", "measured_over_bytes_predicted", ".2f", 9),
           ("reads/rd", "host_reads_per_round", ".2f", 8), ("peak GiB", "peak_gib", ".2f", 8),
           ("= generate", "equal_generate", "", 10), ("= Vanilla", "equal_vanilla", "", 10)]
PATH_LABELS = {"off": "eager", "graphs": "graphs", "on": "fused graphs", "auto": "compile=auto"}  # compile → path


def parse_args(argv=None):
    ap = h.parser("gpu", __doc__)
    ap.add_argument("--model", default="random",
                    help="random (a Llama of --shape with random weights) or a model config, e.g. testbed")
    ap.add_argument("--shape", default="llama2-7b", choices=sorted(SHAPES), help="the random model's matrix sizes")
    shape = ap.add_argument_group("the random model's shape, beyond --shape's")
    for name in SHAPES["tiny"]:
        shape.add_argument(f"--{name.replace('_', '-')}", type=int, default=None)
    ap.add_argument("--task", default="code", help="a model config's prompts: code (the held-out prompts of its "
                    "training run: model=testbed) or a task name")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--loop", default="auto", choices=("auto", "fused", "eager"), help="our decoder-layer loop")
    ap.add_argument("--captured", default="graphs,on", type=captured_settings,
                    help="compile settings of the graph-captured rows, comma-separated: graphs (the eager kernels "
                    "captured), on (inductor's fused kernels captured; torch.compile off CUDA), auto; off: eager "
                    "rows only")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=128, help="the random model's prompt length (ids)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--configs", default=None, help="comma-separated E:γ for LS and assistant_early_exit (default: "
                    "the random model's L/4:6, a model config's own LS setting)")
    ap.add_argument("--no-del", action="store_true", help="leave out the DEL rows")
    ap.add_argument("--vanilla-only", default="", type=lambda t: [x for x in t.split(",") if x],
                    help="compile settings (off, graphs, on, auto) whose path gets the Vanilla row alone")
    ap.add_argument("--del-lookahead", type=int, default=None, metavar="K",
                    help="also DEL reading its stop decisions K candidates at a time (method.lookahead): fewer host "
                    "reads, the candidates drafted past a stop paid for")
    ap.add_argument("--peers", default="all", choices=("all", "generate", "none"),
                    help="transformers' rows: generate and assistant_early_exit, generate alone (the '= generate' "
                    "reference), or none (then no '= generate')")
    ap.add_argument("--no-peers", dest="peers", action="store_const", const="none", help="--peers none")
    ap.add_argument("--batch", type=int, default=1, metavar="B",
                    help="also Vanilla and LS at batch_size=B (the round driver's batch; on the fused graphs' "
                    "path where it runs, else the first captured path's, else eager), after the other rows, "
                    "B prompts at a time")
    ap.add_argument("--bandwidth", type=float, default=None, help="GB/s (default: the device's nominal, or a probe)")
    ap.add_argument("--probe-mb", type=int, default=512, help="the GEMV bandwidth probe's weight (MiB; more than the "
                    "GPU's L2, so every rep reads it from memory)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads on CPU")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.batch > 1 and args.prompts < args.batch:
        ap.error(f"--batch {args.batch} needs --prompts {args.batch} or more (its slots filled)")
    for name, value in SHAPES[args.shape].items():  # the random shape resolved: what the result file's settings say
        if args.model == "random" and getattr(args, name) is None:
            setattr(args, name, value)
    return args


def model_overrides(args) -> list[str]:
    """model=tiny-random at the bench's shape: what the records say the model was."""
    return ["model=tiny-random", f"model.num_layers={args.layers}", f"model.hidden_size={args.hidden}",
            f"model.num_heads={args.heads}", f"model.num_kv_heads={args.kv_heads}",
            f"model.intermediate_size={args.intermediate}", f"+model.vocab_size={args.vocab}",
            f"model.dtype={args.dtype}", f"model.device={args.device}", f"model.seed={args.seed}",
            "model.late_residual_scale=1.0", "model.init_std=0.02"]


def build_model(args, device: torch.device | str):
    """A Llama of the args' shape with transformers' random init, made on the device in the dtype (no host copy)."""
    return random_model({k: getattr(args, k) for k in SHAPES["tiny"]}, args.dtype, device, args.seed)


def random_model(shape: dict, dtype: str, device: torch.device | str, seed: int):
    """A Llama of `shape` (SHAPES' keys) with transformers' random init, made on the device in the dtype (no EOS: every
    row runs to the end)."""
    return random_llama(llama_config(shape), DTYPES[dtype], device, seed)


def captured_settings(text: str) -> list[str]:
    """--captured's comma-separated compile settings ('off' or nothing: none)."""
    settings = [t for t in text.split(",") if t and t != "off"]
    unknown = [t for t in settings if t not in PATH_LABELS or t == "off"]
    if unknown:
        raise ValueError(f"--captured: {', '.join(unknown)} not among graphs, on, auto, off")
    return settings


def nominal_gbps(device_name: str) -> float | None:
    """The data-sheet HBM bandwidth of a GPU by its torch.cuda.get_device_name (None: not in NOMINAL_GBPS)."""
    return next((gbps for key, gbps in NOMINAL_GBPS if key in device_name), None)


@torch.inference_mode()
def probe_bandwidth(device: torch.device, dtype: torch.dtype, megabytes: int, reps: int = 20) -> dict:
    """What one-token decoding can stream here at best: y = W @ x over a W of `megabytes` MiB in `dtype` (more than the
    caches hold, so every rep reads it from memory), timed after a warm-up — on CUDA with CUDA events around each rep
    (no host clock, no launch gap), elsewhere by the host clock around a synchronised call. → {gbps (the fastest rep),
    median_gbps, megabytes, dtype, timer}."""
    cols = 4096
    rows = max(1, megabytes * 2**20 // (cols * torch.tensor([], dtype=dtype).element_size()))
    w = torch.randn(rows, cols, dtype=dtype, device=device)
    x = torch.randn(cols, 1, dtype=dtype, device=device)
    y = torch.empty(rows, 1, dtype=dtype, device=device)
    cuda = device.type == "cuda"
    seconds = event_seconds(lambda: torch.mm(w, x, out=y), reps) if cuda else \
        h.timings(lambda: torch.mm(w, x, out=y), reps, warmup=2)
    size = w.numel() * w.element_size() / 1e9
    return {"gbps": size / min(seconds), "median_gbps": size / statistics.median(seconds), "megabytes": megabytes,
            "dtype": str(dtype).removeprefix("torch."), "timer": "cuda events" if cuda else "host clock"}


def event_seconds(fn, reps: int, warmup: int = 3) -> list[float]:
    """Seconds of each of `reps` calls of fn on the current CUDA stream by CUDA events, after `warmup` calls."""
    for _ in range(warmup):
        fn()
    marks = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in marks:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) / 1e3 for start, end in marks]


def bandwidth(args, device: torch.device, probed: dict) -> tuple[float, str]:
    """The bandwidth the rows' roofline and HBM columns divide by: --bandwidth, else the data sheet's, else the
    probe's (probed: probe_bandwidth's result, measured in the same run either way: the /probe columns)."""
    if args.bandwidth is not None:
        return args.bandwidth, "--bandwidth"
    nominal = nominal_gbps(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    if nominal is not None:
        return nominal, "nominal"
    return probed["gbps"], "GEMV probe"


def stream_bytes(model) -> dict:
    """Bytes one token streams: a decoder layer's weights, the final norm + LM head, and KV per cached position."""
    config, layers = model.config, model.model.layers
    element = next(layers[0].parameters()).element_size()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return {"layer": sum(p.numel() for p in layers[0].parameters()) * element,
            "head": (model.lm_head.weight.numel() + model.model.norm.weight.numel()) * element,
            "kv_per_position": 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * element,
            "num_layers": config.num_hidden_layers}


def streamed(sample: dict, sizes: dict) -> float:
    """The bytes a sample's decoding streamed at least once from memory: its loaded layers' weights, and the head's
    once per head call (each round's verification, each draft) — the memory-bound cost model's count. A batched
    sample: its share of the batch's loads and head passes (what the batch streamed once for all its rows)."""
    if sample.get("batch"):
        return sample["batch"]["loaded_layers"] * sizes["layer"] + sample["batch"]["head_passes"] * sizes["head"]
    return sample["loaded_layers"] * sizes["layer"] + (sample["rounds"] + sample["drafted"]) * sizes["head"]


def batch_size_of(samples: list[dict]) -> int:
    return max((s.get("batch") or {}).get("size", 1) for s in samples)


def with_figures(r: dict, sizes: dict, gbps: float, probe_gbps: float, generate_dir: str | None,
                 vanilla_dir: str | None) -> dict:
    """The row's per-prompt speed, roofline and HBM fraction (of `gbps`, and of the probe's `probe_gbps`), tokens per
    streamed byte, host reads a round, peak memory and its outputs against generate's and its path's Vanilla's
    (harness.lossless_vs: the near-tie rule), from its records."""
    samples = read_jsonl(Path(r["out_dir"]) / "samples.jsonl")
    context = statistics.fmean(len(s["prompt_ids"]) + s["generated_tokens"] / 2 for s in samples)
    token_bytes = sizes["layer"] * sizes["num_layers"] + sizes["head"] + sizes["kv_per_position"] * context
    r["batch_size"], r["throughput"] = batch_size_of(samples), throughput(samples)
    speed = r["tokens_per_s"] if r["batch_size"] == 1 else r["throughput"]  # a batch: its tokens ÷ its seconds
    r["roofline_x"] = speed / (gbps * 1e9 / token_bytes)
    r["roofline_probe_x"] = speed / (probe_gbps * 1e9 / token_bytes)
    if not is_peer(r["method"]):  # our rows: what our loop streamed
        if r["batch_size"] == 1:
            rate = statistics.fmean(streamed(s, sizes) / s["wall_s"] for s in samples)  # bytes a second
        else:  # the batch's loads over its wall seconds
            rate = sum(streamed(s, sizes) for s in samples) * r["throughput"] / sum(s["generated_tokens"]
                                                                                     for s in samples)
        r["hbm_fraction"], r["hbm_probe_fraction"] = rate / (gbps * 1e9), rate / (probe_gbps * 1e9)
        r["tokens_per_gb"] = statistics.fmean(s["generated_tokens"] / streamed(s, sizes) * 1e9 for s in samples)
        rounds = [x for x in read_jsonl(Path(r["out_dir"]) / "rounds.jsonl") if x["round"] > 0]
        r["host_reads_per_round"] = statistics.fmean(x["host_syncs"] for x in rounds) if rounds else None
        r["token_acceptance"] = token_acceptance(rounds)
    r["peak_gib"] = max(s["peak_memory_bytes"] or 0 for s in samples) / 2**30
    r.update(h.per_prompt_speed(r["out_dir"]))
    for key, reference_dir, name in (("generate", generate_dir, "generate"), ("vanilla", vanilla_dir, "Vanilla")):
        if reference_dir is not None and reference_dir != r["out_dir"]:
            r[f"vs_{key}"] = h.lossless_vs(r["out_dir"], reference_dir, name)
            r[f"equal_{key}"] = r[f"vs_{key}"]["cell"]
    return r


def token_acceptance(rounds: list[dict]) -> float | None:
    """Accepted ÷ drafts compared: each round's accepted drafts and its first rejected one (the drafts after it are
    never compared) — the per-token probability a draft is accepted, what a synthetic model's `agreement` sets
    (α, accepted ÷ drafted, also counts the drafts after a rejection)."""
    compared = sum(x["accepted"] + (x["accepted"] < x["drafted"]) for x in rounds)
    return sum(x["accepted"] for x in rounds) / compared if compared else None


def with_prediction(rows: list[dict]) -> None:
    """Each of our rows' memory-bound prediction: its tokens per streamed byte ÷ its path's Vanilla's at its batch
    size (what its speedup would be if time were bytes), and its measured speedup ÷ that; a batched row's speedup by
    throughput over that Vanilla's, and its scaling (`×B=1`): its throughput over the same method's at batch size 1
    on its path."""
    vanilla = {(r["path"], r.get("batch_size")): r for r in rows if r.get("method") == "vanilla"}
    alone = {(r["path"], r.get("method_tag")): r for r in rows if r.get("batch_size") == 1}
    for r in rows:
        if r.get("batch_size", 1) > 1:
            partner, single = vanilla.get((r["path"], r["batch_size"])), alone.get((r["path"], r.get("method_tag")))
            r["speedup"] = ratio(r["throughput"], partner and partner["throughput"])
            r["scaling"] = ratio(r["throughput"], single and single["throughput"])
        base = (vanilla.get((r.get("path"), r.get("batch_size"))) or {}).get("tokens_per_gb")
        if r.get("tokens_per_gb") and base:
            r["bytes_predicted_speedup"] = r["tokens_per_gb"] / base
            if r.get("speedup") is not None:
                r["measured_over_bytes_predicted"] = r["speedup"] / r["bytes_predicted_speedup"]


def ratio(value, base) -> float | None:
    return value / base if value is not None and base else None


def compile_state(summary: dict) -> dict:
    """Whether the row's last decoding session ran the captured steps, and why not (its setup line)."""
    first, last = (summary.get("setup") or [{}])[0], (summary.get("setup") or [{}])[-1]
    return {"compile": last.get("compile"), "graphs": bool(last.get("compiled")), "graph_kind": last.get("graph_kind"),
            "graphs_made": first.get("graphs"), "compile_s": first.get("compile_s"),  # the first session made them
            "compile_reason": last.get("reason"), "compile_fallbacks": last.get("fallbacks"),
            # the draft chains (engine/draft_chain.py: DEL's, DV's, LS's): how many were captured, or why none could be
            "draft_chains": first.get("draft_chains"), "draft_chain_error": first.get("draft_chain_error")}


def main(argv: list[str]) -> int:
    bench(parse_args(argv))
    return 0


def random_prompts(args) -> list[dict]:
    rng = random.Random(args.seed)
    return [{"id": f"random-{i}", "prompt": random_text(rng, args.prompt_len - 1)}
            for i in range(args.prompts)]  # + <s>: prompt-len ids


def setup_model(args, device: torch.device) -> tuple[list[str], object, dict]:
    """(overrides every row shares, the rows' loader, what the header says of the model)."""
    common = [f"max_new_tokens={args.max_new_tokens}", f"layers={args.loop}", f"threads={args.threads}"]
    if args.model == "random":
        t0 = time.perf_counter()
        model = build_model(args, device)
        if device.type == "cuda":  # the initialisation's kernels are queued: the time is theirs done
            torch.cuda.synchronize(device)
        built = {"build_s": time.perf_counter() - t0}
        stack = stack_of(model, layers=args.loop)
        loaded = (Loaded(model, AnyIdTokenizer(), args.layers, str(device)), stack)
        base = [*model_overrides(args), *h.prompts_task(Path(args.root) / "prompts.jsonl", random_prompts(args)),
                *common, *args.set]
        return base, lambda: loaded, {**built, "model": model, "stack": stack}
    prompts = (h.prompts_task(Path(args.root) / "prompts.jsonl", random_prompts(args))
               if args.model.startswith("synthetic") else h.task_overrides(args.task, args.model, args.root))
    base = [f"model={args.model}", f"model.device={device}", f"model.dtype={args.dtype}", *prompts, *common,
            *args.set]
    load = h.shared_load(h.compose(*base))
    t0 = time.perf_counter()
    loaded, stack = load()
    return base, load, {"build_s": time.perf_counter() - t0, "model": loaded.model, "stack": stack}


def make_rows(args, base: list[str], load, grid: list[tuple[int, int]]) -> tuple[dict[str, list[h.BenchRow]], list]:
    """The rows by path — eager (ours with compile=off and the peers) and captured (ours with --captured) — and the
    batched ones among them (--batch: Vanilla and LS at batch_size=B on the fused graphs' path, else the first
    captured one's, else eager)."""
    def row(label, *overrides, method=None, suffix="", may_fail=False):
        return h.row(label, args.root, args.experiment, *base, *overrides, load=load, method=method, suffix=suffix,
                     may_fail=may_fail)

    def ours(setting: str) -> list[h.BenchRow]:
        path, suffix = f"({PATH_LABELS[setting]})", "" if setting == "off" else f"-compile_{setting}"
        options = dict(suffix=suffix, may_fail=setting != "off")
        rows = [row(f"Vanilla {path}", "method=vanilla", f"compile={setting}", **options)]
        if setting not in args.vanilla_only:
            rows += [row(f"LS(E{e}-γ{g}) {path}", *h.ls_args("ls", e, g), f"compile={setting}", **options)
                     for e, g in grid]
        if not args.no_del and setting not in args.vanilla_only:
            rows.append(row(f"DEL {path}", "method=del", f"compile={setting}", **options))
            if args.del_lookahead:
                k = args.del_lookahead
                rows.append(row(f"DEL lookahead {k} {path}", "method=del", f"+method.lookahead={k}",
                                f"method.tag=del-lookahead{k}", f"compile={setting}", **options))
        return rows

    def batched(setting: str) -> list[h.BenchRow]:
        B, path = args.batch, PATH_LABELS[setting]
        options = dict(suffix=f"-compile_{setting}-b{B}", may_fail=setting != "off")
        methods = [("Vanilla", ["method=vanilla"]), *((f"LS(E{e}-γ{g})", h.ls_args("ls", e, g)) for e, g in grid[:1])]
        return [row(f"{label} B={B} ({path})", *overrides, f"compile={setting}", f"batch_size={B}", **options)
                for label, overrides in methods]

    peers = [row("HF generate †", "compile=off", method=peer_method("hf_generate"))] if args.peers != "none" else []
    if args.peers == "all":
        peers += [row(f"HF assistant_early_exit(E{e}-γ{g}) †", "compile=off",
                      method=peer_method("hf_assistant_early_exit", exit_layer=e, gamma=g)) for e, g in grid]
    by_path = {"eager": [*ours("off"), *peers], **{PATH_LABELS[setting]: ours(setting) for setting in args.captured}}
    if args.batch <= 1:
        return by_path, []
    setting = "on" if "on" in args.captured else (args.captured or ["off"])[0]
    extra = batched(setting)
    by_path[PATH_LABELS[setting] if setting != "off" else "eager"] += extra
    return by_path, extra


def bench(args, probe=probe_bandwidth) -> dict:
    """The bench's rows and figures (what it prints and writes; the result file is rewritten after every prompt's
    rows, so a bench stopped at its time limit leaves what it measured). probe: (device, dtype, MiB) → its figures
    (probe_bandwidth; tests pass their own)."""
    device = torch.device(args.device)
    base, load, model_info = setup_model(args, device)
    model, stack = model_info["model"], model_info["stack"]
    L = model.config.num_hidden_layers
    grid = h.grid_of(args.configs or (f"{max(1, L // 4)}:6" if args.model == "random" else None), args.model,
                     whole=False)
    by_path, batched = make_rows(args, base, load, grid)
    probed = probe(device, DTYPES[args.dtype], args.probe_mb)  # with the model loaded, as its rows decode
    gbps, source = bandwidth(args, device, probed)
    sizes = stream_bytes(model)
    shape = (f"{args.layers} layers × {args.hidden} ({args.heads}/{args.kv_heads} heads, {args.intermediate} MLP, "
             f"{args.vocab} vocab), random" if args.model == "random" else f"{args.model} ({L} layers)")
    print(f"{shape}, {args.dtype} on {device}, made in {model_info['build_s']:.1f} s; our loop: {stack.layer_path}; "
          f"bandwidth {gbps:.3g} GB/s ({source}), {probed['gbps']:.3g} GB/s probed ({probed['megabytes']} MiB "
          f"{probed['dtype']} GEMV, {probed['timer']})", flush=True)
    report = {"model": args.model, "layer_path": stack.layer_path, "build_s": model_info["build_s"],
              "synthetic": getattr(model, "synthetic", None), "bandwidth_gbps": gbps, "bandwidth_source": source,
              "probe": probed,
              "bytes": sizes, "launches_per_layer": launches(stack, args), "rows": []}
    print(f"kernel launches a layer (one decode token): {report['launches_per_layer']}", flush=True)
    h.write_result(args.out, "gpu", vars(args), **report)
    rows = [r for path in by_path.values() for r in path if all(r is not b for b in batched)]
    prompts_done = iter(range(args.prompts + 1))

    def write_so_far():
        if next(prompts_done):  # before prompt i > 0: the figures of prompts 0 .. i-1
            report["rows"] = results_of(by_path, sizes, gbps, probed['gbps'])
            h.write_result(args.out, "gpu", vars(args), **report)

    h.run_rows(rows, args.prompts, before_prompt=write_so_far)
    if batched:  # after every other row's figures are written: B prompts at a time, so each batch's slots fill
        report["rows"] = results_of(by_path, sizes, gbps, probed['gbps'])
        h.write_result(args.out, "gpu", vars(args), **report)
        h.run_rows(batched, args.prompts, step=args.batch)
    report["rows"] = results_of(by_path, sizes, gbps, probed['gbps'])
    h.print_table(report["rows"], COLUMNS)
    print_notes(report["rows"])
    h.write_result(args.out, "gpu", vars(args), **report)
    return report


def results_of(by_path: dict[str, list[h.BenchRow]], sizes: dict, gbps: float, probe_gbps: float) -> list[dict]:
    """Every row's figures from its records so far (a row that failed: its failure)."""
    ran = [r for r in h.finished([r for path in by_path.values() for r in path]) if r.summary]  # run so far
    table = dict(zip(map(id, ran), h.table(ran)))

    def out_dir_of(path: str, method: str) -> str | None:  # the path's run of `method` one prompt at a time
        return next((table[id(r)]["out_dir"] for r in by_path[path] if id(r) in table
                     and table[id(r)]["method"] == method and int(r.cfg.get("batch_size", 1)) == 1), None)

    generate_dir = out_dir_of("eager", "hf_generate")
    results = []
    for path, path_rows in by_path.items():
        vanilla_dir = out_dir_of(path, "vanilla")
        for r in path_rows:
            if r.failure:
                results.append({"row": r.label, "path": path, "failure": r.failure, "out_dir": r.cfg.out_dir})
            elif id(r) in table:
                t = with_figures({**table[id(r)], "path": path}, sizes, gbps, probe_gbps, generate_dir, vanilla_dir)
                results.append(t if is_peer(t["method"]) else {**t, **compile_state(r.summary)})
    with_prediction(results)
    return results


def launches(stack: LayerStack, args) -> dict:
    """Kernel launches of one decoder layer at one decode position, by path: eager (the static step's own kernels,
    what `graphs` captures) and fused (inductor's, what `on` captures) — on CUDA the profiler's device kernels and
    copies, on a CPU the calls inside the compiled graph (its C++ kernels and the library calls beside them) and
    the eager step's top-level ops. Errors are reported, not raised (a bench row must not end the bench)."""
    out = {}
    for path, backend in (("eager", None), ("fused", "inductor")):
        if path == "fused" and "on" not in args.captured and "auto" not in args.captured:
            continue
        try:
            out[path] = count_launches(stack, backend)
        except Exception as err:  # noqa: BLE001 — a compile that fails here fails in its rows too, with the reason
            out[path] = f"{type(err).__name__}: {err}"[:200]
    return out


@torch.inference_mode()
def count_launches(stack: LayerStack, backend) -> int:
    """Launches of one layer's static step (compiled with `backend`, or eager) at width 1 (see launches)."""
    import torch._inductor.config as inductor_config
    from torch.profiler import ProfilerActivity, profile

    from del_bench.engine.static_steps import StaticSteps, StepFunctions, adopt

    device = stack.layers[0].device
    cache = stack.new_cache(64)
    adopt(cache)
    with inductor_config.patch({"cpp.enable_kernel_profile": True}):  # each C++ kernel a profiler event
        layer = StepFunctions(StaticSteps(stack), backend).layer
        h = torch.randn(1, 1, stack.embed_weight.shape[1], dtype=stack.dtype, device=device)
        positions = torch.tensor([[3]], device=device)
        call = lambda: layer(stack.layers[0], h, positions, cache.k[0], cache.v[0])  # noqa: E731
        for _ in range(2):
            call()
        stack.synchronize()
        cuda = device.type == "cuda"
        with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
            call()
            stack.synchronize()
    events = prof.events()
    if cuda:
        return sum(e.device_type == torch.autograd.DeviceType.CUDA for e in events)
    if backend is None:
        return sum(e.cpu_parent is None and e.name.startswith("aten::") for e in events)
    return sum(e.cpu_parent is not None and e.cpu_parent.name.startswith("## Call CompiledFxGraph") for e in events)


def print_notes(rows: list[dict]) -> None:
    """Per-prompt speeds, departures from generate, captured rows that did not run graphs, and refused rows."""
    width = max(len(r["row"]) for r in rows)
    print("\ntok/s per prompt, in decode order (1st/rest: the first ÷ the median of the rest):")
    for r in rows:
        if "per_prompt" in r:
            print(f"  {r['row']:<{width}}  " + " ".join(f"{v:.1f}" for v in r["per_prompt"]))
    for r in rows:
        note = (r.get("vs_generate") or {}).get("note")
        if note:
            print(f"{r['row']}: {note}")
        if r["path"] != "eager" and "failure" not in r and not r.get("graphs"):
            print(f"{r['row']}: decoded without graphs ({r.get('compile_reason') or 'no reason recorded'})")
        if "failure" in r:
            print(f"{r['row']}: not run — {r['failure']}")
