"""The package's shape, held so a newcomer can follow it: one module decides the layer path (engine/path_choice.py:
nothing else branches on the `compile` or `layers` settings, and nothing on the decode path branches on `batch_size`),
no module is over 600 lines and no class over 300, and a new draft shape is one engine file plus its method (a toy
shape defined here plugs in that way: registered by its class, found by its name, driven by the batch)."""

from __future__ import annotations

import ast
import copy
from pathlib import Path

import torch

from del_bench.engine.decode import Engine
from del_bench.engine.sampling import Sampling
from del_bench.engine.steps import SHAPES, Draft, DraftShape, Verified, shape_named
from del_bench.methods.base import EARLY_EXIT, Method, Plan
from del_bench.models.layer_stack import LayerStack
from tests.conftest import tiny_model
from tests.test_engine import hf_greedy

PACKAGE = Path(__file__).resolve().parent.parent / "del_bench"
DECIDER = PACKAGE / "engine" / "path_choice.py"
# where the layer path was once decided, among others: the decode path, which must take it from the decider
DECODE_PATH = [*(PACKAGE / "engine").glob("*.py"), PACKAGE / "session.py", PACKAGE / "config.py",
               PACKAGE / "runner.py"]
MAX_MODULE, MAX_CLASS = 600, 300


def setting_reads(node: ast.AST, keys: set[str]) -> bool:
    """Whether an expression reads one of the run config's `keys` off a run config (named cfg or config in this
    package): cfg.get("key", …), cfg["key"], cfg.key."""
    def is_config(value: ast.AST) -> bool:
        return isinstance(value, ast.Name) and value.id in ("cfg", "config")

    for sub in ast.walk(node):
        if (isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute) and sub.func.attr == "get"
                and is_config(sub.func.value) and sub.args and isinstance(sub.args[0], ast.Constant)
                and sub.args[0].value in keys):
            return True
        if (isinstance(sub, ast.Subscript) and is_config(sub.value) and isinstance(sub.slice, ast.Constant)
                and sub.slice.value in keys):
            return True
        if isinstance(sub, ast.Attribute) and sub.attr in keys and is_config(sub.value):
            return True
    return False


def branches_on(path: Path, keys: set[str]) -> list[str]:
    """Every condition in the module (if, while, a conditional expression, a boolean operand, an assert, a
    comprehension's filter) that reads one of `keys` — directly or through a name assigned from such a read in the
    same function."""
    tree = ast.parse(path.read_text())
    found = []
    for scope in [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))]:
        tainted = {t.id for n in ast.walk(scope) if isinstance(n, ast.Assign) and setting_reads(n.value, keys)
                   for t in n.targets if isinstance(t, ast.Name)}
        for n in ast.walk(scope):
            tests = ([n.test] if isinstance(n, (ast.If, ast.While, ast.IfExp, ast.Assert))
                     else n.values if isinstance(n, ast.BoolOp) else n.ifs if isinstance(n, ast.comprehension)
                     else [])
            for test in tests:
                names = {x.id for x in ast.walk(test) if isinstance(x, ast.Name)}
                if setting_reads(test, keys) or names & tainted:
                    found.append(f"{path.relative_to(PACKAGE.parent)}:{test.lineno}")
    return sorted(set(found))


def test_one_module_decides_the_layer_path():
    """`compile` and `layers` are read to decide in engine/path_choice.py only; `batch_size` decides nothing on the
    decode path (the batch of one is the same driver: engine/batch.py) — the runner's records alone say whether a
    run was batched (SampleRecord.batch, per the record contract), which is not a branch on how it decodes.
    Mutant caught: session.build choosing the graphs itself on cfg.compile (as it did, with the batch's on the side)."""
    # (train-exits' own config has a `layers` key: the exit layers to train, not the decoder-layer loop)
    everywhere = [p for p in PACKAGE.rglob("*.py") if p != DECIDER and p.parent.name != "train"]
    assert branches_on(DECIDER, {"compile", "batch_size"})  # the decider does decide: the check can see it
    assert [hit for p in everywhere for hit in branches_on(p, {"compile", "layers"})] == []
    path = [p for p in DECODE_PATH if p != DECIDER and p.name != "runner.py"]
    assert [hit for p in path for hit in branches_on(p, {"batch_size"})] == []


def test_no_module_over_600_lines_and_no_class_over_300():
    """Mutant caught: any module or class grown past the cap (records.py was 700 lines, the Engine class 503)."""
    long_modules, long_classes = [], []
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        if text.count("\n") > MAX_MODULE:
            long_modules.append(f"{path.relative_to(PACKAGE.parent)}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS:
                long_classes.append(f"{path.relative_to(PACKAGE.parent)}:{node.name}: "
                                    f"{node.end_lineno - node.lineno + 1} lines")
    assert long_modules == [] and long_classes == []


# ---- a new draft shape: one engine file (here, this test's class) plus its method --------------------------------
class EchoDraft(DraftShape):
    """A toy shape: it drafts the pending token itself `budget` times (no layer runs for a draft), then verifies the
    pending token and the drafts through every layer from their embeddings, like the skipping shape."""

    name = "echo_draft_toy"

    def draft(self, batch, slots: list) -> None:
        for s in slots:
            r = s.round
            r.draft = Draft()
            for _ in range(r.plan.budget):
                r.draft.ids.append(r.pending.view(1))
                r.draft.draft_probs.append(None)

    def verify(self, batch, slots: list) -> None:
        st, L = batch.stack, batch.stack.num_layers
        passes = {}
        for s in slots:
            r = s.round
            ids = torch.cat([r.pending.view(-1), *(i.view(-1) for i in r.draft.ids)])[None]  # [1, d+1]
            passes[s] = batch.passing(st.embed(ids), r.n - 1, 0, L)
        out, _ = batch.step(passes)
        for s in slots:
            s.round.verified = Verified(st.norm(out[s]), None, st.head)


class Echo(Method):
    """The toy shape's policy: draft `gamma` echoes a round (the engine's plan caps them at the tokens left)."""

    name, label, family, draft_shape = "echo_toy", "Echo", EARLY_EXIT, "echo_draft_toy"

    def __init__(self, gamma: int = 2, **_):
        self.gamma = gamma

    def plan(self) -> Plan:
        return Plan(exit_layer=4, max_draft=self.gamma)

    def describe(self) -> dict:
        return {"gamma": self.gamma}


def test_a_new_draft_shape_is_one_engine_file_plus_its_method():
    """EchoDraft registers by being defined; the batch finds it by the method's draft_shape and runs it at B = 1 and
    at B = 3; its greedy outputs are generate's (it is verified like any draft). Mutant caught: a shape registry that
    the batch does not consult (a shape hard-wired by plan)."""
    assert SHAPES["echo_draft_toy"] is shape_named("echo_draft_toy")
    model, tok = tiny_model()
    prompts = [tok(p)["input_ids"] for p in ("def f(x):", "1, 1, 1, 1,", "The cat")]
    refs = [hf_greedy(model, p, 12) for p in prompts]
    stack = LayerStack(model)
    engine = Engine(stack, Sampling(), set())
    gens = [engine.generate(p, Echo(3), 12, seed=0) for p in prompts]
    assert [g.output_ids for g in gens] == refs
    assert sum(r.accepted for g in gens for r in g.rounds) > 0  # "1, 1, 1, 1," echoes are accepted: not vacuous
    from del_bench.engine.batch import Batch
    from del_bench.engine.row import Request

    out = {}

    def decode(slot, i):
        out[i] = (yield Request(prompts[i], copy.deepcopy(Echo(3)), 12, seed=i)).output_ids

    Batch(stack, 3, Sampling(), set(), cache_len=32).run(range(3), decode)
    assert [out[i] for i in range(3)] == refs
