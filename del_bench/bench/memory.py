"""DEL's peak memory over Vanilla's on a long prompt (Table 5's memory overhead) against the state DEL must keep.

Each method decodes one long prompt (the README's text, tokenized and repeated to --prompt-tokens, as a `prompts`
task) once to warm up, then --reps times, as runs with records interleaved rep by rep; a run's
samples.jsonl holds its peak (del_bench/memory.py: CUDA, the allocator's peak; CPU, the process's peak RSS, reset
before each sample — made to follow live memory here first). The least of the reps counts; the overhead is a
method's least peak minus the first method's. "kept" is the state DEL needs: (L − 1) layers × min(prefill_window, P)
positions × D of prefill states (the shadow window of a round is small).
"""

from __future__ import annotations

from pathlib import Path

from hydra.utils import instantiate

from del_bench import memory
from del_bench.bench import harness as h
from del_bench.records import read_jsonl

README = Path(__file__).resolve().parents[2] / "README.md"


def parse(argv):
    ap = h.parser("memory", __doc__)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--methods", default="vanilla,del", help="the first is the baseline")
    ap.add_argument("--reps", type=int, default=3, help="runs per method, interleaved; the least counts")
    ap.add_argument("--model-set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="model config overrides, e.g. hidden_size=256 (a tiny-random model of another shape)")
    return ap.parse_args(argv)


def long_prompt(tokenizer, n: int) -> str:
    """About n tokens of the README's text (repeated as needed): a long, ordinary prompt."""
    ids = list(tokenizer(README.read_text(), add_special_tokens=False)["input_ids"])
    return tokenizer.decode((ids * (n // len(ids) + 1))[: n - 1])  # + the tokenizer's <s>


def kept_bytes(method, prompt_tokens: int, num_layers: int, hidden: int, item: int) -> int:
    """Bytes of prefill states a shadow-token method keeps: (L − 1) layers × its window × D."""
    return (num_layers - 1) * min(method.prefill_window, prompt_tokens) * hidden * item if method.wants_shadow else 0


def main(argv: list[str]) -> int:
    args = parse(argv)
    base = [f"model={args.model}", *(f"model.{o}" for o in args.model_set), f"max_new_tokens={args.new_tokens}",
            *args.set]
    load = h.shared_load(h.compose(*base))
    loaded, stack = load()
    if not loaded.device.startswith("cuda"):
        memory.rss_follows_live_memory()
    task = h.prompts_task(Path(args.root) / "prompt.jsonl",
                          [{"id": "readme", "prompt": long_prompt(loaded.tokenizer, args.prompt_tokens)}])
    names = args.methods.split(",")
    # rep 0 warms every method up before any is measured: what one leaves allocated (lazy tables, the allocator's
    # pools) must not count against the method measured after it
    runs = [h.row(f"{name} rep {k}", args.root, args.experiment, *base, *task, f"method={name}", load=load,
                  suffix=f"-rep{k}") for k in range(args.reps + 1) for name in names]
    rows = h.run_rows(runs, 1)[len(names):]
    samples = {r.cfg.out_dir: read_jsonl(Path(r.cfg.out_dir) / "samples.jsonl")[0] for r in rows}
    peaks = {name: min(samples[r.cfg.out_dir]["peak_memory_bytes"] for r in rows if r.cfg.method.name == name)
             for name in names}
    P = len(samples[rows[0].cfg.out_dir]["prompt_ids"])
    D, L, item = stack.config.hidden_size, stack.num_layers, stack.head_weight.element_size()
    kept = {r.cfg.method.name: kept_bytes(instantiate(r.cfg.method), P, L, D, item) for r in rows}
    result = {"model": args.model, "prompt_tokens": P, "new_tokens": args.new_tokens, "layer_path": stack.layer_path,
              "measure": samples[rows[0].cfg.out_dir]["memory_measure"], "peak_bytes": peaks,
              "overhead_bytes": {n: peaks[n] - peaks[names[0]] for n in names[1:]}, "kept_state_bytes": kept,
              "all_positions_bytes": (L - 1) * P * D * item, "runs": [r.cfg.out_dir for r in rows]}
    mib = 2**20  # MiB, two decimals: a tiny model keeps a few dozen KiB
    print(f"{args.model}, {P}-token prompt, {args.new_tokens} new tokens, {stack.layer_path} layers; "
          f"{result['measure']}")
    for name in names:
        line = f"  {name:10s} peak {peaks[name] / mib:9.2f} MiB"
        if name != names[0]:
            line += (f"   overhead {(peaks[name] - peaks[names[0]]) / mib:+8.2f} MiB   (state it keeps: "
                     f"{kept[name] / mib:.2f} MiB; every prompt position of L − 1 layers would be "
                     f"{result['all_positions_bytes'] / mib:.2f} MiB)")
        print(line)
    h.write_result(args.out, "memory", vars(args), **result)
    return 0
