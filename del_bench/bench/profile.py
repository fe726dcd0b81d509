"""What a cold prompt pays: each timed prompt of a run profiled (torch.profiler), the first against the last.

The first GPU run (issue 36) decoded its first two timed prompts ~7× slower than the rest after a 16-token warm-up.
This bench sets a run up as `run` does (session.build, then the run's warm-up: `--set warmup=quick` for the old one,
`warmup=steady`), decodes its prompts one by one, untimed by the runner, each under torch.profiler (CPU ops, and on
CUDA the kernels and the CUDA runtime calls: module loads, allocations, launches), and prints per prompt its wall
milliseconds per token and the ops whose total time the first prompt spends beyond the last one's — what a cold
prompt loads, plans or allocates. The result file keeps every prompt's top ops. No records are written.
"""

from __future__ import annotations

import copy
import time

from hydra.utils import instantiate
from torch.profiler import ProfilerActivity, profile

from del_bench import runner, session
from del_bench.bench import harness as h
from del_bench.selection import select_samples


def parse(argv):
    ap = h.parser("profile", __doc__, limit=4, max_new_tokens=96)
    ap.add_argument("--top", type=int, default=12, help="ops listed per prompt")
    return ap.parse_args(argv)


def op_totals(prof) -> dict[str, dict]:
    """name → {calls, cpu_ms (self), device_ms (self)} of every op the profile saw."""
    out = {}
    for e in prof.key_averages():
        device = getattr(e, "self_device_time_total", None)
        if device is None:
            device = getattr(e, "self_cuda_time_total", 0)
        out[e.key] = {"calls": e.count, "cpu_ms": e.self_cpu_time_total / 1e3, "device_ms": device / 1e3}
    return out


def extra(first: dict, last: dict, top: int) -> list[dict]:
    """The ops the first prompt spends the most time on beyond the last prompt (CPU + device self time)."""
    def total(ops, name):
        op = ops.get(name, {})
        return op.get("cpu_ms", 0.0) + op.get("device_ms", 0.0)

    rows = [{"op": name, "first_ms": round(total(first, name), 3), "last_ms": round(total(last, name), 3),
             "first_calls": first[name]["calls"], "last_calls": last.get(name, {}).get("calls", 0)}
            for name in first]
    rows.sort(key=lambda r: r["last_ms"] - r["first_ms"])
    return rows[:top]


def main(argv: list[str]) -> int:
    args = parse(argv)
    cfg = h.compose(f"max_new_tokens={args.max_new_tokens}", f"limit={args.limit}", *args.set)
    task = instantiate(cfg.task)
    samples = select_samples(task, cfg)
    ready = session.build(cfg, task=task, samples=samples)
    device = ready.stack.head_device
    warmup = runner.warm_up(cfg, runner.rows_of(ready, 1, 1024), ready, samples)
    print(f"{cfg.model.name} {cfg.method.tag} on {device}, warm-up {warmup.get('mode')} "
          f"(passes ms/token {warmup.get('ms_per_token')}), layer path {ready.stack.layer_path}, "
          f"graphs {ready.setup.get('compiled')}")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    prompts = []
    for i, sample in enumerate(samples):
        ids = ready.tokenizer(sample.prompt if sample.turns is None else task.render(sample, []))["input_ids"]
        with profile(activities=activities) as prof:
            ready.stack.synchronize()
            t0 = time.perf_counter()
            gen = ready.engine.generate(ids, copy.deepcopy(ready.method), args.max_new_tokens, runner.sample_seed(
                cfg.seed, sample.id, 0))
            ready.stack.synchronize()
            wall = time.perf_counter() - t0
        prompts.append({"sample_id": sample.id, "tokens": len(gen.output_ids), "wall_s": wall,
                        "ms_per_token": 1e3 * wall / max(1, len(gen.output_ids)), "ops": op_totals(prof)})
        print(f"  prompt {i}: {prompts[-1]['ms_per_token']:.2f} ms/token ({len(gen.output_ids)} tokens; profiled)")
    extras = extra(prompts[0]["ops"], prompts[-1]["ops"], args.top) if len(prompts) > 1 else []
    if extras:
        print("ops the first prompt spends beyond the last (ms, calls):")
        for r in extras:
            print(f"  {r['op'][:60]:60s} {r['first_ms']:9.2f} vs {r['last_ms']:9.2f}  "
                  f"({r['first_calls']} vs {r['last_calls']} calls)")
    for p in prompts:  # the result file: each prompt's top ops by self time
        p["ops"] = dict(sorted(p["ops"].items(), key=lambda kv: -(kv[1]["cpu_ms"] + kv[1]["device_ms"]))[:args.top])
    h.write_result(args.out, "profile", vars(args), warmup=warmup, setup=ready.setup, prompts=prompts,
                   first_extra=extras)
    return 0
