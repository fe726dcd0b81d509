"""A Llama-2-7B-shaped random model on a GPU: ours vs HF generate and assistant_early_exit, HBM roofline, memory.

The model is built in code with random weights (no hub), in the dtype on the device; transformers' rows (†, peers)
run on the same weights (LayerStack re-points HF's modules at its own storage: one copy). Every row is a run with
records (model=tiny-random at this shape, random byte prompts as a `prompts` task, no EOS: every row runs to the
end), interleaved prompt by prompt after the runner's untimed warm-up; the engine's and the peers' clocks are read
after a device synchronisation.

Per row, from its records: tok/s (mean over prompts), roofline (tok/s ÷ the memory-bandwidth roofline of one-token
decoding: bandwidth ÷ the bytes a token streams — every layer's weights, the final norm and LM head, and the KV
cache at the mean context; a speculative row can exceed 1), HBM (our rows: the bytes our loop streamed ÷ seconds ÷
bandwidth: loaded layers × a layer's bytes + (rounds + drafted) × the head's bytes), eTPL, α, peak memory and how
many outputs equal generate's. Bandwidth: --bandwidth GB/s, else the device's data-sheet figure, else a GEMV probe.
Random weights rarely agree across depths, so the rows measure mechanics (a round's cost, the roofline, memory), not
a LayerSkip checkpoint's speedups.
"""

from __future__ import annotations

import random
import statistics
from pathlib import Path

import torch

from del_bench.bench import harness as h
from del_bench.bench.peers import peer_method
from del_bench.models.layer_stack import LayerStack
from del_bench.models.loading import DTYPES, ByteTokenizer, Loaded
from del_bench.records import is_peer, read_jsonl

NOMINAL_GBPS = (  # (substring of torch.cuda.get_device_name, GB/s): HBM bandwidth from the vendors' data sheets
    ("H200", 4800.0), ("H100 PCIe", 2000.0), ("H100 NVL", 3900.0), ("H100", 3350.0),  # first match wins
    ("A100-SXM4-80GB", 2039.0), ("A100 80GB PCIe", 1935.0), ("A100", 1555.0),
    ("L40S", 864.0), ("A10G", 600.0), ("A10", 600.0), ("L4", 300.0), ("V100", 900.0),
)
COLUMNS = ["row", "tok/s", ("roofline", "roofline_x", ".3g", 8), ("HBM", "hbm_fraction", ".2f", 5), "eTPL", "α",
           ("peak GiB", "peak_gib", ".2f", 8), ("= generate", "equal_generate", "", 10)]


def parse_args(argv=None):
    ap = h.parser("gpu", __doc__)
    shape = ap.add_argument_group("model shape (default: Llama-2-7B)")
    shape.add_argument("--layers", type=int, default=32)
    shape.add_argument("--hidden", type=int, default=4096)
    shape.add_argument("--heads", type=int, default=32)
    shape.add_argument("--kv-heads", type=int, default=32)
    shape.add_argument("--intermediate", type=int, default=11008)
    shape.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--loop", default="auto", choices=("auto", "fused", "eager"), help="our decoder-layer loop")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--configs", default="8:6", help="comma-separated E:γ for LS and assistant_early_exit")
    ap.add_argument("--no-del", action="store_true", help="leave out the DEL row")
    ap.add_argument("--bandwidth", type=float, default=None, help="GB/s (default: the device's nominal, or a probe)")
    ap.add_argument("--probe-mb", type=int, default=512, help="matrix size of the GEMV bandwidth probe")
    ap.add_argument("--threads", type=int, default=2, help="torch threads on CPU")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


class AnyIds(ByteTokenizer):
    """The random model's prompts are bytes; its outputs are any id of its vocabulary, decoded as numbers; no EOS."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(map(str, ids))


def model_overrides(args) -> list[str]:
    """model=tiny-random at the bench's shape: what the records say the model was."""
    return ["model=tiny-random", f"model.num_layers={args.layers}", f"model.hidden_size={args.hidden}",
            f"model.num_heads={args.heads}", f"model.num_kv_heads={args.kv_heads}",
            f"model.intermediate_size={args.intermediate}", f"+model.vocab_size={args.vocab}",
            f"model.dtype={args.dtype}", f"model.device={args.device}", f"model.seed={args.seed}",
            "model.late_residual_scale=1.0", "model.init_std=0.02"]


def build_model(args, device: torch.device):
    """A Llama with random weights of the given shape, initialised on the device in the dtype (no float32 copy)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=4096,
                         bos_token_id=None, eos_token_id=None, pad_token_id=0)  # no EOS: every row runs to the end
    torch.manual_seed(args.seed)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(DTYPES[args.dtype])
    try:
        with device:
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default_dtype)
    return model.eval()


def nominal_gbps(device_name: str) -> float | None:
    """The data-sheet HBM bandwidth of a GPU by its torch.cuda.get_device_name (None: not in NOMINAL_GBPS)."""
    return next((gbps for key, gbps in NOMINAL_GBPS if key in device_name), None)


@torch.inference_mode()
def probe_bandwidth(device: torch.device, dtype: torch.dtype, megabytes: int, reps: int = 10) -> float:
    """GB/s of y = W @ x over a W of `megabytes` (larger than the caches): what one-token decoding streams at best."""
    cols = 4096
    rows = max(1, megabytes * 2**20 // (cols * torch.tensor([], dtype=dtype).element_size()))
    w = torch.randn(rows, cols, dtype=dtype, device=device)
    x = torch.randn(cols, 1, dtype=dtype, device=device)

    return w.numel() * w.element_size() / min(h.timings(lambda: torch.mm(w, x), reps, warmup=1)) / 1e9


def bandwidth(args, device: torch.device) -> tuple[float, str]:
    if args.bandwidth is not None:
        return args.bandwidth, "--bandwidth"
    nominal = nominal_gbps(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    if nominal is not None:
        return nominal, "nominal"
    return probe_bandwidth(device, DTYPES[args.dtype], args.probe_mb), "GEMV probe"


def stream_bytes(model, args) -> dict:
    """Bytes one token streams: a decoder layer's weights, the final norm + LM head, and KV per cached position."""
    element = model.model.embed_tokens.weight.element_size()
    layer_bytes = sum(p.numel() for p in model.model.layers[0].parameters()) * element
    head_bytes = (model.lm_head.weight.numel() + model.model.norm.weight.numel()) * element
    kv_per_position = 2 * args.layers * args.kv_heads * (args.hidden // args.heads) * element
    return {"layer": layer_bytes, "head": head_bytes, "kv_per_position": kv_per_position, "num_layers": args.layers}


def with_roofline(r: dict, sizes: dict, gbps: float, context: float, generate_dir: str) -> dict:
    """The row's roofline, HBM fraction, peak memory and outputs equal to generate's, from its samples.jsonl."""
    samples = read_jsonl(Path(r["out_dir"]) / "samples.jsonl")
    token_bytes = sizes["layer"] * sizes["num_layers"] + sizes["head"] + sizes["kv_per_position"] * context
    r["roofline_x"] = r["tokens_per_s"] / (gbps * 1e9 / token_bytes)
    if not is_peer(r["method"]):  # our rows: what our loop streamed
        r["hbm_fraction"] = statistics.fmean(
            (s["loaded_layers"] * sizes["layer"] + (s["rounds"] + s["drafted"]) * sizes["head"]) / s["wall_s"]
            for s in samples) / (gbps * 1e9)
    r["peak_gib"] = max(s["peak_memory_bytes"] or 0 for s in samples) / 2**30
    r["equal_generate"] = "{}/{}".format(*h.outputs_equal(r["out_dir"], generate_dir))
    return r


def main(argv: list[str]) -> int:
    bench(parse_args(argv))
    return 0


def bench(args) -> dict:
    """The bench's rows and figures (what it prints and writes)."""
    device = torch.device(args.device)
    model = build_model(args, device)
    stack = LayerStack(model, layers=args.loop)
    loaded = (Loaded(model, AnyIds(), args.layers, str(device)), stack)
    rng = random.Random(args.seed)
    words = [{"id": f"random-{i}", "prompt": "".join(chr(rng.randrange(33, 127)) for _ in range(args.prompt_len - 1))}
             for i in range(args.prompts)]  # + <s>: prompt-len ids
    base = [*model_overrides(args), *h.prompts_task(Path(args.root) / "prompts.jsonl", words),
            f"max_new_tokens={args.max_new_tokens}", f"layers={args.loop}", f"threads={args.threads}", *args.set]

    def row(label, *overrides, method=None):
        return h.row(label, args.root, args.experiment, *base, *overrides, load=lambda: loaded, method=method)

    rows = [row("Vanilla", "method=vanilla"), row("HF generate †", method=peer_method("hf_generate"))]
    for e, g in h.grid_of(args.configs, "tiny-random"):
        rows += [row(f"LS(E{e}-γ{g})", *h.ls_args("ls", e, g)),
                 row(f"HF assistant_early_exit(E{e}-γ{g}) †",
                     method=peer_method("hf_assistant_early_exit", exit_layer=e, gamma=g))]
    if not args.no_del:
        rows.append(row("DEL", "method=del"))
    gbps, source = bandwidth(args, device)
    sizes = stream_bytes(model, args)
    print(f"{args.layers} layers × {args.hidden} ({args.heads}/{args.kv_heads} heads, {args.intermediate} MLP, "
          f"{args.vocab} vocab), {args.dtype} on {device}; our loop: {stack.layer_path}; bandwidth {gbps:.0f} GB/s "
          f"({source})")
    table = h.table(h.run_rows(rows, args.prompts))
    context = args.prompt_len + args.max_new_tokens / 2
    table = [with_roofline(r, sizes, gbps, context, table[1]["out_dir"]) for r in table]
    h.print_table(table, COLUMNS)
    report = {"layer_path": stack.layer_path, "bandwidth_gbps": gbps, "bandwidth_source": source, "bytes": sizes,
              "rows": table}
    h.write_result(args.out, "gpu", vars(args), **report)
    return report
