"""bench del-stop (issue 51): DEL's stop on τ four ways — its CPU dry run checks what a GPU run's figures rest on:
each way drafts the candidates the read-per-candidate way drafts, bit for bit, and runs the steps it claims (the
conditional way stops at d, masked continuation runs the whole budget)."""

import pytest
import torch

from del_bench.bench import del_stop


@torch.inference_mode()
def test_every_way_drafts_reads_candidates_and_runs_its_own_steps():
    result = del_stop.measure(del_stop.SHAPES["tiny"], budget=5, stops=[1, 3, 5], reps=1, dtype=torch.float32,
                              device=torch.device("cpu"))
    rows = {(r["d"], r["way"]): r for r in result["rows"]}
    assert set(rows) == {(d, way) for d in (1, 3, 5) for way in del_stop.WAYS}
    for d in (1, 3, 5):
        assert all(rows[d, way]["equal_read"] for way in del_stop.WAYS)
        steps = {way: rows[d, way]["steps"] for way in del_stop.WAYS}
        assert steps == {"read": d, "conditional": d, "masked": 5, "ideal": d}
        # host reads: one a candidate, then the round's; a graph way reads once (eagerly the flag's tests count too)
        assert rows[d, "read"]["reads"] == d + 1 and rows[d, "masked"]["reads"] == rows[d, "ideal"]["reads"] == 1
        assert rows[d, "conditional"]["reads"] == 5 + 1 and rows[d, "ideal"]["over_ideal"] == 1


@torch.inference_mode()
def test_the_candidates_depend_on_the_context():
    """The candidates are the layer's, not constants: another round's context (the cache) changes them, so equality
    between the ways is not vacuous."""
    drafter = del_stop.DraftStep(del_stop.SHAPES["tiny"], 4, torch.float32, torch.device("cpu"))
    drafter.reset(4)
    for _ in range(4):
        drafter.step()
    first, confidences, ran = drafter.read()
    assert ran == 4 and len(set(confidences)) > 1
    for layer in drafter.layers:
        layer["k"].mul_(-1)
    drafter.reset(4)
    for _ in range(4):
        drafter.step()
    assert drafter.read()[1] != confidences


def test_stops_beyond_the_budget_are_refused():
    with pytest.raises(SystemExit):
        del_stop.parse(["--budget", "4", "--stops", "2,5"])
