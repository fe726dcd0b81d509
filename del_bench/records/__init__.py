"""A run's records in its out_dir, and resuming them safely.

    run_config.json   the settings that define the run (resume refuses a different one)
    costs.json        measured layer/head costs of a calibrated run and the device they were measured on (reused
                      by a resume on that device only)
    method_state.json what a method carries across prompts (Method.state: SWIFT's search with scope run, DV
                      without reset), as it stood after the `samples` finished samples, and the one before it
                      (`previous`): written before a sample's records, so a resume finds the one that matches
    samples.jsonl     one line per generated output (written after its rounds)
    rounds.jsonl      one line per round
    summary.json      written atomically at the end, recomputed from samples.jsonl; its `run_key` says
                      which run this is (RunKey) and so which Vanilla run it pairs with

This package is the record contract every reader shares: the per-round line (`Round`, defined beside the engine
that fills it: del_bench/engine/rounds.py), the per-sample line (`SampleRecord`), the run's identity (`RunKey`)
and the one pairing rule (`RunKey.pairs_with`), and the two rules of whether a run's timing can be trusted
(`overloaded`: a busy machine; `steady_state`: a cold start). The runner writes them; `show`, `report`, `calibrate`
and the bench scripts read them through `run_key_of`, which also adapts records written before run_key existed.
One module a concern: sample.py (the per-sample line and what samples add up to), identity.py (RunKey and pairing),
timing.py (load, steady state, drift), labels.py (how methods are named), run_dir.py (the directory and resuming).

A sample counts as finished once its samples.jsonl line is complete. On resume, a torn last line and
the rounds of unfinished samples are dropped, so nothing is lost or duplicated.
"""

from __future__ import annotations

from del_bench.errors import RunConflict  # noqa: F401 (raised by RunDir; readers catch it from here)
from del_bench.records.identity import (  # noqa: F401
    RunKey,
    batch_label,
    decoding_tag,
    machine_of,
    prompt_digest,
    prompts_fingerprint,
    run_key_of,
    vanilla_baseline,
    vanilla_partners,
)
from del_bench.records.labels import (  # noqa: F401
    PEER_MARK,
    PEER_NOTE,
    MethodEntry,
    is_peer,
    method_entry,
    method_label,
)
from del_bench.records.run_dir import (  # noqa: F401
    ADDED_MODEL_OPTIONS,
    ADDED_RUN_OPTIONS,
    COST_UNITS,
    RESUMABLE_KEYS,
    RESUMABLE_MODEL_KEYS,
    RESUMABLE_TASK_KEYS,
    Key,
    RunDir,
    add_experiment,
    cost_units,
    drop_experiment,
    key_of,
    read_jsonl,
    write_json,
)
from del_bench.records.sample import (  # noqa: F401
    TURN_FIELDS,
    SampleRecord,
    batch_etpl,
    host_reads,
    throughput,
)
from del_bench.records.timing import (  # noqa: F401
    DRIFT_LIMIT,
    LOAD_TOLERANCE_CORES,
    MIN_PROBE_S,
    MIN_TICKS_INTERVAL_S,
    STEADY_SLOWDOWN,
    decode_seconds_per_layer,
    drifted,
    free_cores,
    load_summary,
    machine_probe,
    other_cores,
    overloaded,
    steady_state,
    unsteady,
)
