"""Policies on scripted rounds, with hand-computed values."""

import pytest
from hydra.utils import get_class, instantiate

import del_bench.methods.peers  # noqa: F401 -- the peers register when imported, as the readers of their records do
from del_bench.config import CONFIG_DIR
from del_bench.methods import method_class
from del_bench.methods.base import LAYER_SKIPPING, PEER, UNBOUNDED, RoundEvidence, StaticShape
from del_bench.methods.dv import DraftVerify
from del_bench.methods.fs import FiniteState
from del_bench.records import method_entry
from tests.test_imports import import_graph


def rounds(method, outcomes):
    """Feed (drafted, accepted) rounds; return the plans seen before each round."""
    plans = []
    for drafted, accepted in outcomes:
        plans.append(method.plan().max_draft)
        method.observe(RoundEvidence(exit_layer=method.exit_layer, drafted=drafted, accepted=accepted))
    return plans


def test_fs_grows_on_full_acceptance_and_shrinks_to_the_floor():
    fs = FiniteState(exit_layer=3, gamma=2)
    fs.start(8)
    assert rounds(fs, [(2, 2), (3, 3), (4, 1), (3, 0), (2, 0), (1, 0)]) == [2, 3, 4, 3, 2, 1]
    assert fs.plan().max_draft == 1  # floor 1
    fs.start(8)
    assert fs.plan().max_draft == 2  # reset per prompt


def test_fs_without_floor_counts_an_empty_round_as_all_accepted():
    fs = FiniteState(exit_layer=3, gamma=1, floor=0)
    fs.start(8)
    assert rounds(fs, [(1, 0), (0, 0), (1, 1)]) == [1, 0, 1]
    assert fs.plan().max_draft == 2


def test_fs_ignores_the_budget_capped_last_round():
    fs = FiniteState(exit_layer=3, gamma=4)
    fs.start(8)
    fs.observe(RoundEvidence(exit_layer=3, drafted=1, accepted=0, budget_capped=True))
    assert fs.plan().max_draft == 4


def test_dv_threshold_update_by_hand():
    dv = DraftVerify(exit_layer=2, acceptance="round")
    dv.start(8)
    assert dv.keep_drafting(0, 0.6) and not dv.keep_drafting(0, 0.59)
    dv.observe(RoundEvidence(exit_layer=2, drafted=4, accepted=1))
    # AR = 0.5·0 + 0.5·0.25 = 0.125 < 0.8 → θ̃ = 0.61; θ = 0.9·0.6 + 0.1·0.61 = 0.601
    assert dv.ar == pytest.approx(0.125) and dv.theta == pytest.approx(0.601)
    dv.observe(RoundEvidence(exit_layer=2, drafted=2, accepted=2))
    # AR = 0.5·0.125 + 0.5·1 = 0.5625 < 0.8 → θ̃ = 0.611; θ = 0.9·0.601 + 0.1·0.611 = 0.602
    assert dv.theta == pytest.approx(0.602)


def test_dv_cumulative_acceptance_and_reset():
    dv = DraftVerify(exit_layer=2, acceptance="cumulative", target_acceptance=0.3)
    dv.start(8)
    dv.observe(RoundEvidence(exit_layer=2, drafted=4, accepted=1))  # cum 0.25 → AR 0.125 < 0.3
    dv.observe(RoundEvidence(exit_layer=2, drafted=4, accepted=4))  # cum 5/8 → AR 0.375 ≥ 0.3 → θ − ε
    assert dv.ar == pytest.approx(0.375)
    assert dv.theta == pytest.approx(0.9 * 0.601 + 0.1 * 0.591)
    dv.start(8)
    assert (dv.theta, dv.ar) == (0.6, 0.0)
    keep = DraftVerify(exit_layer=2, reset_per_prompt=False)
    keep.start(8)
    keep.observe(RoundEvidence(exit_layer=2, drafted=4, accepted=0))
    keep.start(8)
    assert keep.theta != 0.6  # carried across prompts, as the authors' code does


# ---- what a method says of itself: label, family, order (records.method_entry), static shape (compiled steps) ----
METHOD_CONFIGS = sorted(p.stem for p in (CONFIG_DIR / "method").glob("*.yaml"))


@pytest.mark.parametrize("config", METHOD_CONFIGS)
def test_every_method_config_runs_under_a_name_its_class_answers_to(run_cfg, config):
    """records find a method's class by the name its runs keep (the config's `name:`): it must be the `_target_`'s."""
    method = run_cfg(f"method={config}").method
    assert method_class(method.name) is get_class(method._target_)


@pytest.mark.parametrize("config", METHOD_CONFIGS)
def test_a_methods_static_shape_is_what_its_hyperparameters_fix(run_cfg, config):
    """The exit layer its hyperparameters fix (None where it is chosen round by round) and the budget that bounds its
    rounds (γ, else d_max; FS's γ grows without a cap; plain decoding and AdaDecode's layer-parallel steps: none):
    the graphs path_choice.choose makes before the timed samples."""
    method = instantiate(run_cfg(f"method={config}").method)
    plan = method.describe()
    fixed = plan.get("exit_layer") if isinstance(plan.get("exit_layer"), int) else None
    if config in ("vanilla", "adadecode"):
        expected = StaticShape(None, 0)
    elif config == "fs":
        expected = StaticShape(fixed, UNBOUNDED)
    else:
        expected = StaticShape(fixed, int(plan.get("gamma") or plan.get("d_max")))
    assert method.static_shape() == expected


AUTHORS = {"keep_stopped_draft": True, "prefill_draft": True, "prefill_window": 33}  # DEL as its authors' code runs it
LABELS = [  # (config name, hyperparameters as records keep them, label): the tables' labels of every method
    ("vanilla", {}, "Vanilla"), ("ls", {"exit_layer": 24, "gamma": 4}, "LS(E24-γ4)"),
    ("fs", {"exit_layer": 24, "gamma": 4, "floor": 1}, "FS(E24-γ4)"), ("dv", {"exit_layer": 7, "d_max": 18}, "DV(E7)"),
    ("swift", {"skip_ratio": 0.45, "d_max": 25}, "SWIFT"), ("clasp", {"skip_layers": 8, "gamma": 4}, "CLaSp"),
    ("knapspec", {"gamma": 4}, "KnapSpec"), ("adadecode", {"gamma": 0.75}, "AdaDecode"),
    ("del", {"omega": 0.95, "exit_layer": None, "cost_model": "layers", **AUTHORS}, "DEL"),
    ("del", {"omega": 0.9, "exit_layer": None, **AUTHORS}, "DEL(ω0.9)"),
    ("del", {"omega": 0.95, "exit_layer": None, "cost_model": "layers"}, "DEL (Alg. 1)"),  # every record before them
    ("del", {"omega": 0.95, "cost_model": "measured", "shadow_vocab": 1024}, "DEL-CPU"),
    ("del", {"omega": 0.95, "keep_stopped_draft": True, "first_exit_layer": 1}, "DEL (KnapSpec's)"),
    ("del_gamma", {"omega": 0.95, "exit_layer": 24, **AUTHORS}, "DEL-γ(E24)"),
    ("del_e", {"omega": 0.95}, "DEL-E (Alg. 1)"),
    ("del_e_lim", {"omega": 0.5, "cost_model": "measured", **AUTHORS}, "DEL-E-lim(ω0.5)"),
    ("hf_generate", {"transformers": "4"}, "HF generate†"), ("hf_forward_loop", {}, "HF forward loop†"),
    ("hf_assistant_early_exit", {"exit_layer": 8, "gamma": 6}, "HF assistant_early_exit(E8-γ6)†"),
    ("no_such_method", {"exit_layer": 3}, "no_such_method"),
]


def test_the_peers_register_with_the_methods_and_the_report_imports_no_bench():
    # the peers are methods (methods/peers.py): a reader of their records finds their classes by name, as any method's
    # (method_class imports the package), so the report never reaches up into the bench
    graph = import_graph()
    assert not any(target.startswith("del_bench.bench") for name, targets in graph.items()
                   if name.startswith("del_bench.report") for target in targets)
    assert method_class("hf_generate").__module__ == "del_bench.methods.peers"


def test_each_method_labels_its_runs_and_says_where_its_rows_go():
    entries = [method_entry(name, hp) for name, hp, _ in LABELS]
    assert [e.label for e in entries] == [label for _, _, label in LABELS]
    # the tables' order: ours (Vanilla, LS, FS, DV, SWIFT, CLaSp, KnapSpec, DEL-γ, DEL-E, DEL-E-lim, DEL and its
    # variants), then the peers; a method no class declares after every one that is declared
    ordered = sorted(entries, key=lambda e: e.order)
    assert [e.label for e in ordered] == [
        "Vanilla", "LS(E24-γ4)", "FS(E24-γ4)", "DV(E7)", "SWIFT", "CLaSp", "KnapSpec", "DEL-γ(E24)", "DEL-E (Alg. 1)",
        "DEL-E-lim(ω0.5)", "DEL", "DEL(ω0.9)", "DEL (Alg. 1)", "DEL-CPU", "DEL (KnapSpec's)", "AdaDecode",
        "HF generate†", "HF forward loop†", "HF assistant_early_exit(E8-γ6)†", "no_such_method"]
    families = {label: e.family for (_, _, label), e in zip(LABELS, entries)}
    assert {label for label, f in families.items() if f == LAYER_SKIPPING} == {"SWIFT", "CLaSp", "KnapSpec"}
    assert {label for label, f in families.items() if f == PEER} == {
        "HF generate†", "HF forward loop†", "HF assistant_early_exit(E8-γ6)†"}
    assert [e.note is not None for e in entries if e.label.startswith("DEL")] == [
        True, True, True, True, True, False, False, False]  # DEL's readings say what each is (not the ablations)
