"""The import graph of del_bench has no cycle, and no import runs from a lower layer up to a higher one.

Every module under del_bench/ is parsed with `ast` (nothing is imported) and every `import` / `from … import`
statement is counted, at ANY depth: inside functions, methods, `if TYPE_CHECKING:` and try blocks too, since
an import inside a function is how a circle hides (it only fails when the function runs). Each import is
resolved to the del_bench modules it executes:

  - `import del_bench.a.b` and `from del_bench.a import b`: del_bench.a.b when that is a module (a file or a
    package), else the deepest module the dotted name reaches (`from del_bench.config import validate` →
    del_bench.config; `from del_bench import x` with x not a module → del_bench, its __init__);
  - relative imports are resolved against the importing module's package (an __init__ is its own package);
  - package __init__ files are nodes of the graph (del_bench.models is del_bench/models/__init__.py), and
    importing del_bench.a.b also executes del_bench.a, so an edge goes to every package on the way — except
    the importer's own ancestors: those have already run before the importer's first line, so a submodule
    importing a sibling through its package (a package that re-exports its submodules) is not a cycle.

Imports by name count as well, since an import by name is how an up-link hides from the statements: every string in
the code that is a del_bench dotted name (`importlib.import_module("del_bench.x")`, a tuple of modules to import
later, a Hydra `_target_` written in code), and every f-string that starts with one (`f"del_bench.x.{name}"`),
is an import of the deepest module it names. Strings in the configs' YAML are not code: they name leaf classes
(tasks, methods, jobs.SweepReport) that the top of the graph loads. Imports of other packages are ignored.
Function-level imports are allowed (heavy optional dependencies: matplotlib, wandb, hydra in the CLI), but they count
for the layers as any other import does.

The layers (LAYERS, lowest first): data flows config → engine → records → report, and the imports run the other
way, each module importing only its own layer and those below it: the foundations (with the schema machinery each
layer declares its config keys with); models and methods (the model as
the engine runs it; policies); records (the record contract, which names methods as they name themselves) and tasks;
the engine (the decode loop over a model and a method); config (validation, which builds a Sampling and checks the
compiled steps' setting) and tracking; session (model + task + method + sampling ready to decode, from a config);
the runs (runner, jobs, calibration, train); the report (which reads records only, the peers' among them: their
classes register with the other methods); and on top the benches (which tabulate with the report) and the CLI.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = "del_bench"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE
# a module named by a string: `del_bench` and dotted parts after it, all of the string (not prose that mentions one)
BY_NAME = re.compile(rf"{PACKAGE}(\.[A-Za-z_][A-Za-z0-9_]*)+")


def _modules() -> dict[str, Path]:
    modules = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _imported(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The del_bench modules whose code an import statement in `name` targets (at any depth)."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()

    def resolve(dotted: str) -> str | None:
        """`dotted` itself when a module, else the deepest module prefix (a name inside a module)."""
        while dotted:
            if dotted in modules:
                return dotted
            dotted = dotted.rpartition(".")[0]
        return None

    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                package = name if is_package else name.rpartition(".")[0]
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            targets = [origin] + [f"{origin}.{alias.name}" for alias in node.names if alias.name != "*"]
        else:
            targets = _named(node)
        for target in targets:
            if target != PACKAGE and not target.startswith(PACKAGE + "."):
                continue
            module = resolve(target)
            if module is not None:
                found.add(module)
                found.update(_ancestors(module))
    own = set(_ancestors(name)) | {name}
    return found - own


def _named(node: ast.AST) -> list[str]:
    """The del_bench module a string names, as an import by name would take it: a string that is a dotted name, or
    an f-string's leading constant up to its last whole part (`f"del_bench.bench.{x}"` → del_bench.bench)."""
    if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
        head = str(node.values[0].value)
        whole = head if len(node.values) == 1 else head.rpartition(".")[0]
        return [whole] if BY_NAME.fullmatch(whole) else []
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and BY_NAME.fullmatch(node.value):
        return [node.value]
    return []


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imported(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path [a, b, …, a], or None (iterative DFS, modules in sorted order: deterministic)."""
    WHITE, GREY, BLACK = 0, 1, 2
    colour = dict.fromkeys(graph, WHITE)
    for start in sorted(graph):
        if colour[start] != WHITE:
            continue
        stack = [(start, iter(sorted(graph[start])))]
        colour[start] = GREY
        while stack:
            node, children = stack[-1]
            for child in children:
                if colour.get(child, BLACK) == GREY:
                    path = [n for n, _ in stack]
                    return path[path.index(child):] + [child]
                if colour.get(child) == WHITE:
                    colour[child] = GREY
                    stack.append((child, iter(sorted(graph[child]))))
                    break
            else:
                colour[node] = BLACK
                stack.pop()
    return None


def test_the_import_graph_sees_imports_by_name(tmp_path):
    assert "del_bench.train.trainer" in import_graph()["del_bench.__main__"]  # a module named for import_module
    module = tmp_path / "x.py"
    module.write_text('import importlib\nLATER = ("del_bench.methods.peers",)\n'
                      'def load(n):\n    """Loads del_bench.report, as a docstring may say."""\n'
                      '    importlib.import_module("del_bench.runner")\n'
                      '    return importlib.import_module(f"del_bench.engine.{n}")\n')
    found = _imported("del_bench.methods.x", module, _modules())
    assert {"del_bench.methods.peers", "del_bench.runner", "del_bench.engine"} <= found
    assert "del_bench.report" not in found  # prose in a docstring is not a name


def test_the_import_graph_sees_function_level_and_relative_imports():
    graph = import_graph()
    assert "del_bench.engine.sampling" in graph["del_bench.engine.decode"]  # top-level, absolute
    assert "del_bench.report.collect" in graph["del_bench.report.build"]  # relative (`from .collect import`)
    assert "del_bench.report.figures" in graph["del_bench.report.build"]  # relative, inside a function
    assert "del_bench.train.data" in graph["del_bench.train.trainer"]  # `from del_bench.train import data`
    assert "del_bench.calibration" in graph["del_bench.__main__"]  # inside a function


def tangled(graph: dict[str, set[str]]) -> list[str]:
    """Every module that lies on some cycle (reaches itself)."""
    def reach(start):
        seen, todo = set(), [start]
        while todo:
            for child in graph.get(todo.pop(), ()):
                if child not in seen:
                    seen.add(child)
                    todo.append(child)
        return seen

    return sorted(name for name in graph if name in reach(name))


def test_find_cycle_reports_the_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_import_cycle_in_del_bench():
    graph = import_graph()
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle: {' → '.join(cycle)} (modules on cycles: {', '.join(tangled(graph))})"


def test_errors_is_the_bottom_and_main_the_top():
    graph = import_graph()
    assert graph["del_bench.errors"] == set(), "del_bench.errors must import nothing from del_bench"
    importers = sorted(name for name, targets in graph.items() if "del_bench.__main__" in targets)
    assert not importers, f"nothing may import del_bench.__main__: {importers}"


# lowest first: a module may import its own layer and the layers below it only (a module's layer: its longest prefix)
LAYERS = [
    ("foundations", ["del_bench", "del_bench.errors", "del_bench.numerics", "del_bench.averages", "del_bench.transfer",
                     "del_bench.memory",
                     "del_bench.machine_load", "del_bench.git_state", "del_bench.sandbox", "del_bench.selection",
                     "del_bench.calibration_store", "del_bench.metrics", "del_bench.schema"]),
    ("models and methods", ["del_bench.models", "del_bench.methods"]),
    ("records and tasks", ["del_bench.records", "del_bench.specbench", "del_bench.tasks"]),
    ("engine", ["del_bench.engine"]),
    ("config", ["del_bench.config", "del_bench.tracking"]),
    ("session", ["del_bench.session"]),
    ("runs", ["del_bench.runner", "del_bench.jobs", "del_bench.calibration", "del_bench.train"]),
    ("lm-eval", ["del_bench.lm_eval_backend", "del_bench.lm_eval_crosscheck", "del_bench.lm_eval_tasks"]),
    ("report", ["del_bench.report"]),
    ("top", ["del_bench.bench", "del_bench.__main__"]),
]


def layer_of(module: str) -> int | None:
    """The index in LAYERS of the entry that is `module` or its longest package prefix (the root package, del_bench's
    __init__, is itself only); None: in no layer."""
    best = None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            within = module == prefix or (prefix != PACKAGE and module.startswith(prefix + "."))
            if within and (best is None or len(prefix) > best[0]):
                best = (len(prefix), index)
    return None if best is None else best[1]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import from a module to one in a higher layer, as 'importer (layer) → imported (layer)'."""
    found = []
    for importer, targets in sorted(graph.items()):
        for target in sorted(targets):
            if layer_of(target) > layer_of(importer):
                found.append(f"{importer} ({LAYERS[layer_of(importer)][0]}) → {target} "
                             f"({LAYERS[layer_of(target)][0]})")
    return found


def test_every_module_lies_in_a_layer():
    assert layer_of("del_bench.lm_eval") is None  # a new top-level module is placed in LAYERS by whoever adds it
    assert [name for name in import_graph() if layer_of(name) is None] == []


def test_upward_imports_are_found_at_any_depth():
    graph = {"del_bench.engine.decode": {"del_bench.runner"}, "del_bench.runner": {"del_bench.engine.decode"},
             "del_bench.records": {"del_bench.methods"}}
    assert upward_imports(graph) == ["del_bench.engine.decode (engine) → del_bench.runner (runs)"]


def test_no_import_runs_up_the_layers():
    upward = upward_imports(import_graph())
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(upward)


# ---- the engine calls down into the model's stack and keeps nothing of its own there (static_steps.memo holds what the
# graphs of one stack share); a module over MAX_LINES is split by concern
MAX_LINES = 700
STACK_NAMES = {"stack", "st"}  # how the engine's code names a LayerStack (also self.stack, self._stack)


def _stack_expr(node: ast.AST) -> bool:
    if isinstance(node, ast.Name):
        return node.id in STACK_NAMES
    return isinstance(node, ast.Attribute) and node.attr in {"stack", "_stack"} and isinstance(node.value, ast.Name)


def stack_own_attributes() -> set[str]:
    """The attributes LayerStack's own code sets on itself (self.x = … anywhere in models/)."""
    own = set()
    for path in (ROOT / "models").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            for t in targets:
                for leaf in ast.walk(t) if t is not None else ():
                    if isinstance(leaf, ast.Attribute) and isinstance(leaf.value, ast.Name) and leaf.value.id in {
                            "self", "stack"}:
                        own.add(leaf.attr)
    return own


def engine_state_on_stack(source: str, own: set[str]) -> list[str]:
    """Where engine code stores something on a stack: an attribute the models never set (`stack.compiled = …`),
    `setattr(stack, …)` or `stack.__dict__`, as 'line: what'."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for leaf in ast.walk(t):
                    if isinstance(leaf, ast.Attribute) and _stack_expr(leaf.value) and leaf.attr not in own:
                        found.append(f"{node.lineno}: sets .{leaf.attr}")
        if isinstance(node, ast.Attribute) and node.attr == "__dict__" and _stack_expr(node.value):
            found.append(f"{node.lineno}: reads __dict__")
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
                and node.args and _stack_expr(node.args[0])):
            found.append(f"{node.lineno}: setattr")
    return found


def test_the_engine_stores_nothing_on_the_models_stack():
    own = stack_own_attributes()
    assert {"counter", "products", "wide_products"} <= own and "compiled" not in own
    for mutant in ("stack.compiled = graphs", "stack.__dict__.setdefault('_made', {})", "setattr(st, 'x', 1)",
                   "self.stack._graphs = {}"):
        assert engine_state_on_stack(mutant, own), mutant
    assert engine_state_on_stack("counter, self.stack.counter = self.stack.counter, None", own) == []
    found = {str(p.relative_to(ROOT.parent)): engine_state_on_stack(p.read_text(), own)
             for p in (ROOT / "engine").rglob("*.py")}
    assert {p: f for p, f in found.items() if f} == {}


def test_no_module_is_over_the_line_limit():
    long = {str(p.relative_to(ROOT.parent)): n for p in ROOT.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}, f"split these by concern (at most {MAX_LINES} lines a module): {long}"
