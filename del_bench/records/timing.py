"""Whether a run's timing can be trusted: the machine's load around each sample (`overloaded`: a busy machine), a
cold start (`steady_state`: the first samples slower than the rest per loaded layer), and the machine's state
against its Vanilla partner's (`drifted`: their product probes differ beyond DRIFT_LIMIT)."""

from __future__ import annotations

import math
from statistics import median
from typing import Iterable

from del_bench.records.run_dir import Key, key_of

# CPUs other processes may keep busy beyond the free ones (cores − torch threads) before a sample is flagged:
# /proc/stat counts in 10 ms ticks and a daemon's blip is no contention, while one other busy process is a whole core
LOAD_TOLERANCE_CORES = 0.5


# below this interval /proc/stat's ticks are too coarse to tell our CPU time from others' (20 ticks a CPU at 100 Hz):
# such a sample is judged by the load average instead
MIN_TICKS_INTERVAL_S = 0.2


def free_cores(load: dict) -> int:
    """The cores torch's threads leave to everything else."""
    return load["cores"] - load["torch_threads"]


def other_cores(load: dict | None) -> float | None:
    """CPUs other processes kept busy around a sample: the busy CPUs less our own over the interval (/proc/stat);
    for a short interval or off Linux, the larger load average less torch's threads (ours while decoding, which
    the load average counts too); None when nothing was recorded."""
    if not load:
        return None
    busy, own = load.get("busy_cores"), load.get("own_cores")
    if busy is not None and own is not None and load["interval_s"] >= MIN_TICKS_INTERVAL_S:
        return max(0.0, busy - own)
    averages = [a for a in (load.get("loadavg_before"), load.get("loadavg_after")) if a is not None]
    return max(0.0, max(averages) - load["torch_threads"]) if averages else None


def overloaded(load: dict | None) -> bool:
    """True when other processes kept more CPUs busy than torch's threads left free (by more than
    LOAD_TOLERANCE_CORES): the sample was timed on a machine it shared, its speed is not to be trusted. False when
    no load was recorded (older records)."""
    other = other_cores(load)
    return other is not None and other > free_cores(load) + LOAD_TOLERANCE_CORES


def load_summary(samples: list[dict]) -> dict | None:
    """A run's load, from its samples: how many recorded one, how many were overloaded (a run with any is flagged:
    speed is a mean over samples, and one slowed sample moves it), the most CPUs others kept busy around one, and
    the fewest free cores; None when no sample recorded its load (older records)."""
    loads = [s["load"] for s in samples if s.get("load")]
    if not loads:
        return None
    others = [o for o in map(other_cores, loads) if o is not None]
    return {"samples": len(loads), "overloaded": sum(map(overloaded, loads)),
            "max_other_cores": max(others) if others else None, "free_cores": min(map(free_cores, loads))}


# the run's first timed sample may take up to this many times the median decode seconds per loaded layer of its other
# samples before the run is flagged as not timed at steady state. On the committed CPU reference records (2-core CPU,
# 0.1–0.3 s samples, other jobs beside them) the ratio reaches 1.72 (99th percentile 1.47 over the 569 runs of two or
# more samples); the failure it is for (issue 36: the first prompts on a GPU after a 16-token warm-up) was 7
STEADY_SLOWDOWN = 2.0


def _seconds(round_: dict) -> float:
    return round_["draft_s"] + round_["verify_s"] + round_["policy_s"]


def decode_seconds_per_layer(sample: dict, rounds: list[dict]) -> float | None:
    """A sample's decode seconds per loaded layer: its rounds after the prefill (round 0 of every turn: a prefill's
    cost grows with the prompt) ÷ the layers they loaded; for a sample without round lines (a peer's: transformers
    decodes), its wall seconds ÷ loaded layers. None when nothing was decoded after the prefill.

    Per loaded layer, not per token: a token's time depends on how many drafts were accepted, a layer's much less —
    on the reference records the first sample's ratio to the rest spreads 0.90–1.27 (5th–95th percentile) per layer
    against 0.76–1.41 per token."""
    if not rounds:
        layers = sample.get("loaded_layers")
        return sample["wall_s"] / layers if layers and sample.get("wall_s") else None
    decode = [r for r in rounds if r["round"] > 0]
    layers = sum(r["loaded_layers"] for r in decode)
    return sum(map(_seconds, decode)) / layers if layers else None


def steady_state(samples: list[dict], rounds: list[dict], setup: list[dict] = ()) -> dict | None:
    """Whether a run's samples were timed at steady state — the one rule `show`, the report and the benches apply,
    from the records alone (samples.jsonl in decoding order, rounds.jsonl, setup.jsonl). A run is not at steady
    state when
    - a session's warm-up did not converge (its setup line's warmup.converged is false: `warmup: steady` decoded its
      cap of passes without two in a row agreeing on their per-token time), or
    - one of its first two timed samples took more than STEADY_SLOWDOWN times the median decode seconds per loaded
      layer of the samples after it (decode_seconds_per_layer): a cold start that the warm-up did not absorb. Only
      slower counts (a faster first sample is no warm-up's failure); the median keeps half of the later samples slow
      from hiding it, and the second sample's own check keeps two slow samples of three from hiding each other.
    Returns {"first_slowdown": the first sample's ratio, "lead_slowdown": the larger of the first two samples'
    (None with fewer than two timed samples), "warmups_unconverged": sessions, "steady": bool}, or None when there
    is nothing to judge (one sample and no warm-up recorded)."""
    by_sample: dict[Key, list[dict]] = {}
    for r in rounds:
        by_sample.setdefault(key_of(r), []).append(r)
    per_layer = [decode_seconds_per_layer(s, by_sample.get(key_of(s), [])) for s in samples]
    per_layer = [v for v in per_layer if v]
    leading = [per_layer[i] / median(per_layer[i + 1 :]) for i in range(min(2, len(per_layer) - 1))]
    slowdown = leading[0] if leading else None
    lead = max(leading) if leading else None
    warmups = [line["warmup"] for line in setup if isinstance(line.get("warmup"), dict)]
    unconverged = sum(w.get("converged") is False for w in warmups)
    if slowdown is None and not warmups:
        return None
    return {"first_slowdown": slowdown, "lead_slowdown": lead, "warmups_unconverged": unconverged,
            "steady": not unconverged and (lead is None or lead <= STEADY_SLOWDOWN)}


def unsteady(state: dict | None) -> bool:
    """A run's steady_state says it was not timed at steady state (False for None: nothing to judge)."""
    return bool(state) and not state["steady"]


# A run and its Vanilla partner must have been timed on the machine in one state: a VM's host can make the same matrix
# products several times slower from one day to the next (this 2-core VM: the SmolLM2 layer products' one-row time,
# median 2.0 ms over one day's 116 runs, 6.0 ms another day, with nothing else running), which no load sampling sees.
# A speedup whose run and partner differ by more than this factor in machine_probe is marked (the report's §).
DRIFT_LIMIT = 1.5


# Below this a probe is call overhead and timer noise, not the machine: the testbed's (11.5M parameters, ~1 ms) ranged
# 0.3–1.5 ms between runs minutes apart; SmolLM2's is ~18 ms, a 7B model's in bf16 on one H100/H200 ~3–4 ms.
MIN_PROBE_S = 2e-3


def machine_probe(setup: list[dict]) -> float | None:
    """Seconds the model's matrix products took for one token when the run set up — a probe of the machine's state
    taken on every run: the sum over shape classes of the one-row time of HF's layout (x_wt) that `products: auto`
    measured on the model's own matrices (the seconds under a setup.jsonl line's products), the median over the run's
    sessions. None where nothing was timed (a forced layout, records from before; half precision before its one-row
    times were taken)."""
    probes = []
    for line in setup:
        seconds = (line.get("products") or {}).get("seconds") or {}
        one_row = [by_rows.get("1", {}).get("x_wt") for shape, by_rows in seconds.items()
                   if not shape.startswith("rows_")]  # rows_B: a batch's widths (products.for_rows)
        if one_row and all(isinstance(t, (int, float)) and t > 0 for t in one_row):
            probes.append(math.fsum(one_row))
    return median(probes) if probes else None


def drifted(probe: float | None, partner_probes: Iterable[float | None]) -> bool:
    """A run's machine_probe and its Vanilla partners' differ by more than DRIFT_LIMIT either way (False where either
    side has none, or one too short to tell: MIN_PROBE_S): its speedup compares two states of the machine, not two
    methods."""
    partners = [p for p in partner_probes if p and p >= MIN_PROBE_S]
    if not probe or probe < MIN_PROBE_S or not partners:
        return False
    ratio = probe / (math.fsum(partners) / len(partners))
    return max(ratio, 1 / ratio) > DRIFT_LIMIT
