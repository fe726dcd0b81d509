"""DEL's peak-memory overhead over Vanilla on a long prompt (Table 5's "memory overhead"), and what DEL must keep.

Both methods decode the same prompt (the README's text, tokenized and repeated to --prompt-tokens) after a warm-up
run each; each measured run is a del_bench.memory.PeakMemory sample, as the runner takes them (CUDA: the allocator's
peak; CPU: the process's peak RSS, reset before each sample). The overhead is DEL's peak minus Vanilla's; "kept"
is the state DEL needs: (L − 1) layers × prefill_window positions × D of prefill states, plus the shadow window of a
round (small). On CPU the runs go through memory.rss_follows_live_memory first, so the RSS peak is live memory.

    python scripts/bench_memory.py [--model smollm2-135m] [--prompt-tokens 2048] [--new-tokens 16]
                                   [--methods vanilla,del] [--reps 3] [--layers auto] [--json out.json]
                                   [--set KEY=VALUE …]   (model config overrides)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from del_bench import memory
from del_bench.config import CONFIG_DIR
from del_bench.engine.decode import Engine
from del_bench.engine.sampling import Sampling
from del_bench.runner import eos_ids, load_model

README = Path(__file__).resolve().parents[1] / "README.md"


def prompt_ids(tokenizer, n: int) -> list[int]:
    """n token ids of the README's text (repeated as needed): a long, ordinary prompt."""
    ids = list(tokenizer(README.read_text())["input_ids"])
    return (ids * (n // len(ids) + 1))[:n]


def method_of(name: str):
    with initialize_config_dir(config_dir=str(CONFIG_DIR / "method"), version_base="1.3"):
        return instantiate(compose(config_name=name))


def peak(engine: Engine, device: str, prompt: list[int], method, new_tokens: int) -> memory.PeakMemory:
    with memory.PeakMemory(device) as measured:
        engine.generate(prompt, method, new_tokens, seed=0)
    return measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--methods", default="vanilla,del", help="the first is the baseline")
    parser.add_argument("--reps", type=int, default=3, help="measured runs per method, interleaved; the least counts")
    parser.add_argument("--layers", default="auto", help="the layer loop: auto | fused | eager")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="model config overrides, e.g. hidden_size=256 (a tiny-random model of another shape)")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    with initialize_config_dir(config_dir=str(CONFIG_DIR / "model"), version_base="1.3"):
        model_cfg = compose(config_name=args.model, overrides=args.set)
    loaded, stack = load_model(model_cfg, args.layers)
    if not loaded.device.startswith("cuda"):
        memory.rss_follows_live_memory()
    engine = Engine(stack, Sampling(), eos_ids(loaded.model, loaded.tokenizer))
    prompt = prompt_ids(loaded.tokenizer, args.prompt_tokens)
    methods = {name: method_of(name) for name in args.methods.split(",")}
    for method in methods.values():  # warm-up: lazy allocations (KV cache, RoPE tables) happen before measuring
        engine.generate(prompt, method, args.new_tokens, seed=0)
    samples = {name: [] for name in methods}
    for _ in range(args.reps):  # interleaved, so drift hits every method alike; the least counts
        for name, method in methods.items():
            samples[name].append(peak(engine, loaded.device, prompt, method, args.new_tokens))
    peaks = {name: min(s.bytes for s in runs) for name, runs in samples.items()}
    base, *others = methods
    item = torch.empty((), dtype=stack.dtype).element_size()
    D, L = stack.config.hidden_size, stack.num_layers
    kept = {name: (L - 1) * min(m.prefill_window, args.prompt_tokens) * D * item if m.wants_shadow else 0
            for name, m in methods.items()}
    result = {"model": args.model, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
              "layer_path": stack.layer_path, "measure": samples[base][0].measure,
              "peak_bytes": peaks, "overhead_bytes": {n: peaks[n] - peaks[base] for n in others},
              "kept_state_bytes": kept,
              "all_positions_bytes": (L - 1) * args.prompt_tokens * D * item}
    mib = 2**20  # MiB, two decimals: a tiny model keeps a few dozen KiB
    print(f"{args.model}, {args.prompt_tokens}-token prompt, {args.new_tokens} new tokens, {stack.layer_path} "
          f"layers; {result['measure']}")
    for name in methods:
        line = f"  {name:10s} peak {peaks[name] / mib:9.2f} MiB"
        if name != base:
            line += (f"   overhead {(peaks[name] - peaks[base]) / mib:+8.2f} MiB   (state it keeps: "
                     f"{kept[name] / mib:.2f} MiB; every prompt position of L − 1 layers would be "
                     f"{result['all_positions_bytes'] / mib:.2f} MiB)")
        print(line)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
