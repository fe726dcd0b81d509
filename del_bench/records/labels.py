"""How tables, `show` and the benches name methods: each method's label, family and order as its class says
(`method_entry`), and the peers' mark (†: transformers' own decoding beside ours)."""

from __future__ import annotations

from dataclasses import dataclass

# a peer's label (transformers' own decoding beside ours: del_bench/methods/peers.py) carries PEER_MARK wherever a
# method is named (show, the tables), with PEER_NOTE under a table that has one
PEER_MARK = "†"


PEER_NOTE = (f"{PEER_MARK} = a peer: transformers' own decoding (generate, a plain loop over its forward, "
             "assistant_early_exit: LayerSkip's self-speculation in transformers) on the same weights and prompts, "
             "written as records like ours (work counted by hooks where it runs; del_bench/methods/peers.py).")


@dataclass(frozen=True)
class MethodEntry:
    """A run's method as tables and `show` present it, as its class declares it (Method.table_label, family,
    table_order, table_note): read from the run's name and hyperparameters alone."""

    label: str  # LS(E4-γ4), DEL-CPU, HF generate†
    family: str  # methods.base.FAMILIES
    order: tuple  # its place among a block's rows (compared with other entries' orders)
    note: str | None = None  # a note under any table with this row


def method_entry(method: str, hyperparameters: dict | None = None) -> MethodEntry:
    """What the class of `method` (a config name, RunKey.method) says of a run of it with these hyperparameters (its
    describe(), as records keep it; e.g. {"exit_layer": 24, "gamma": 4}). A name no class declares (a method whose
    module this process cannot import) keeps its name, after every declared method."""
    from del_bench.methods import method_class
    from del_bench.methods.base import OTHER, PEER, Method

    cls, hyperparameters = method_class(method), hyperparameters or {}
    if cls is None:
        return MethodEntry(method, OTHER, (Method.order,))
    label = cls.table_label(method, hyperparameters) + (PEER_MARK if cls.family == PEER else "")
    return MethodEntry(label, cls.family, cls.table_order(method, hyperparameters),
                       cls.table_note(method, hyperparameters))


def method_label(method: str, hyperparameters: dict | None = None) -> str:
    """Labels as in the paper, as each method's class declares them (method_entry): LS(E8-γ6), FS(E8-γ6), DV(E8),
    DEL's variant (DEL-CPU) and its ω only when not the default; a peer's marked: HF assistant_early_exit(E8-γ6)†."""
    return method_entry(method, hyperparameters).label


def is_peer(method: str) -> bool:
    """True for a peer's run (transformers decoded it, not our engine: del_bench/methods/peers.py)."""
    from del_bench.methods.base import PEER

    return method_entry(method).family == PEER
