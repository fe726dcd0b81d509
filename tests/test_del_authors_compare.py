"""scripts/del_authors_compare.py's comparison, on hand-made rounds: their calls and our rounds aligned by the output
offset they start at (their first call, the prefill with one draft, against our prefill and the plain round after
it), each pair's kind, and the per-sample figures. `drive` needs the DEL authors' checkout and is not run here."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "del_authors_compare.py"
_spec = importlib.util.spec_from_file_location("del_authors_compare", SCRIPT)
compare_script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compare_script)


def ours(*rounds):
    """Our rounds from (exit_layer, budget, drafted, accepted, emitted, loaded_layers[, trace]) tuples, round 0
    first."""
    out = []
    for i, (E, budget, d, k, emitted, loaded, *trace) in enumerate(rounds):
        out.append({"sample_id": "s", "round": i, "exit_layer": E, "budget": budget, "drafted": d, "accepted": k,
                    "emitted": emitted, "loaded_layers": loaded, **(trace[0] if trace else {})})
    return out


def theirs(*calls):
    """Their calls from (exit_layer, drafted, accepted, emitted) tuples."""
    return [{"exit_layer": E, "drafted": d, "accepted": k, "emitted": e} for E, d, k, e in calls]


L = 4
# ours: prefill, the plain round after an accepted prefill draft, then (2, 3 drafts, 1 accepted) at offset 2, ...
OURS = ours((None, 0, 0, 0, 1, L), (None, 0, 0, 0, 1, L, {"prefill_draft": True}), (2, 18, 3, 1, 2, 3 * 2 + L),
            (1, 18, 1, 1, 2, 1 + L), (3, 1, 1, 1, 2, 3 + L))
THEIRS = theirs((1, 1, 1, 2), (2, 3, 1, 2), (1, 1, 1, 2), (3, 5, 5, 6))


def test_rounds_pair_by_the_offset_they_start_at_after_the_first():
    pairs = compare_script.align(OURS, THEIRS)
    assert [(a and a["offset"], b and b["offset"]) for a, b in pairs] == [(0, 0), (2, 2), (4, 4), (6, 6)]
    first = pairs[0][0]
    assert (first["emitted"], first["loaded_layers"]) == (2, 2 * L)  # our prefill and the plain round, together
    kinds = [compare_script.kind_of(a, b, max_new_tokens=8) for a, b in pairs]
    # the last: our budget capped at 8 − 6 − 1 = 1 (the tokens left, less the verifier's), theirs drafts 5 past it
    capped = "our budget capped at the tokens left (theirs runs past max_new_tokens)"
    assert kinds == ["equal", "equal", "equal", capped]


def test_a_round_out_of_step_and_a_different_decision_are_named():
    shifted = theirs((1, 1, 0, 1), (2, 3, 1, 2), (1, 1, 1, 2))  # their draft rejected: one token, then offset 1
    pairs = compare_script.align(OURS, shifted)
    kinds = [compare_script.kind_of(a, b, max_new_tokens=99) for a, b in pairs]
    assert kinds[0] == "first round: the tokens it emits differ"
    assert "out of step (no round of ours at this offset)" in kinds  # their offsets 1 and 3
    assert "out of step (no round of theirs at this offset)" in kinds
    other = theirs((1, 1, 1, 2), (5, 3, 1, 2), (1, 2, 1, 2))
    kinds = [compare_script.kind_of(a, b, max_new_tokens=99) for a, b in compare_script.align(OURS, other)]
    assert kinds[1:3] == ["exit layer differs", "drafted differs"]
    plain = ours((None, 0, 0, 0, 1, L), (None, 0, 0, 0, 1, L), (2, 18, 3, 1, 2, 10))  # TPL's γ = 0: no draft
    kinds = [compare_script.kind_of(a, b, 99) for a, b in compare_script.align(plain, theirs((1, 1, 0, 1),
                                                                                          (1, 2, 0, 1)))]
    assert kinds == ["equal", "we decode plainly (TPL's γ = 0), they draft", "out of step (no round of theirs at "
                     "this offset)"]
    dropped = ours((None, 0, 0, 0, 1, L), (None, 18, 0, 0, 1, 2 + L, {"chosen_exit_layer": 2}))  # Algorithm 1's
    kinds = [compare_script.kind_of(a, b, 99) for a, b in compare_script.align(dropped, theirs((1, 1, 0, 1),
                                                                                            (2, 1, 0, 1)))]
    assert kinds[1] == "we draft nothing (the first candidate fell below τ and was dropped), they keep it"


def test_compare_reads_both_sides_records_and_sums_them(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    out_ids = list(range(8))
    (run / "samples.jsonl").write_text(json.dumps({"sample_id": "s", "output_ids": out_ids, "num_layers": L}) + "\n")
    (run / "rounds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in OURS))
    their_file = tmp_path / "theirs.jsonl"
    their_file.write_text(json.dumps({"authors_commit": "0365a81"}) + "\n" + json.dumps(
        {"sample_id": "s", "output_ids": out_ids + [9, 9], "calls": THEIRS}) + "\n")
    result = compare_script.compare(their_file, run, max_new_tokens=8)
    row = result["rows"][0]
    assert (row["pairs"], row["equal"], row["their_tokens"], row["past_max_new_tokens"]) == (4, 3, 12, 4)
    assert row["theirs_equal_reference"] and row["ours_equal_reference"]  # their 2 tokens past the limit not compared
    their_layers = (1 + L) + (2 * 3 + L) + (1 + L) + (3 * 5 + L)
    assert row["their_etpl"] == 12 / their_layers and row["our_etpl"] == 8 / sum(r["loaded_layers"] for r in OURS)
    assert (row["their_alpha"], row["our_alpha"]) == (8 / 10, 3 / 5)
    assert row["first_round"] == {"their_tokens": 2, "their_layers": 1 + L, "our_tokens": 2, "our_layers": 2 * L}
