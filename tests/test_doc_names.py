"""Every code name the docs give resolves: README.md, docs/*.md, the package's own .md files, its docstrings and
comments.

A docstring that names `_draft_skipping` after the function became `skipping.draft` sends a reader looking for
code that is not there. The package is parsed with `ast` (nothing is imported, so this runs in about a second) into
an index of what exists: modules, their classes, functions and assignments, the names they import, each class's
methods, class attributes, dataclass fields and `self.x` attributes (its package base classes' too), and every
function's parameters.

Which tokens are code names (the rule is strict where a token can only be code, silent where it may be prose):
- In the markdown files, text in backticks; in docstrings and comments, text in backticks and also bare tokens of the
  shapes prose does not produce: `_private` names, dotted names that start at a package name, and `name()`.
- `del_bench.a.b` must resolve from the package root; `a.b.c` whose first part names a package module or class
  (`records.vanilla_baseline`, `LayerStack.exit_logits`, `skipping.draft`) must resolve from it, attribute by
  attribute. A dotted name that does not resolve may still be a config key (`calibration.use`, `sandbox.mode`: a key
  path of some configs/ YAML), and then passes.
- `_name` (a leading underscore), and in backticks `name()` / `Name(args)` and CamelCase names, must exist somewhere
  in the package (or be a builtin).
- Everything else passes unchecked: dotted names of other libraries (`torch.multinomial`) and of variables
  (`draft.early`), bare lowercase words (config keys, record fields, CLI commands), ALL-CAPS names (environment
  variables, labels such as LS(E4-γ4)), file names, shell commands, values such as `E=8`, Hydra's `_target_`.
EXTERNAL lists the few names of other code the docs quote in a checked shape.
"""

from __future__ import annotations

import ast
import builtins
import io
import re
import tokenize
from dataclasses import dataclass, field
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "del_bench"

# Names of other code quoted in a shape the rule checks, each with where it comes from.
EXTERNAL = {
    "LlamaDecoderLayer": "transformers' Llama layer, whose math LayerStack mirrors",
    "Tensor": "torch.Tensor",
    "VmHWM": "the peak-RSS line of Linux's /proc/self/status (del_bench/memory.py)",
    "_norm": "transformers' RMSNorm._norm, quoted in the norms' formulas (families.py, layer_stack.py)",
    "rotary_emb": "transformers' rotary module, called with a layer type by Gemma 3 (families.py)",
    "down": "the MLP's down projection (transformers' down_proj) in families.py's formulas",
    "config": "a transformers model config (config.hidden_act, …) — not del_bench.config",
}
FILE_SUFFIXES = {"py", "md", "yaml", "yml", "json", "jsonl", "txt", "cpp", "csv", "tex", "pdf", "png", "toml",
                 "safetensors", "pt", "gz", "ipynb", "sh", "cfg", "log"}
BACKTICKED = re.compile(r"`([^`\n]+)`")
# a backticked code name: a (dotted) identifier, optionally called
CODE = re.compile(r"^(?P<name>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)(?P<call>\(.*\))?$")
# bare tokens checked in docstrings and comments: _private names, dotted names and name()
BARE = re.compile(r"(?<![\w.`/\\-])(_[A-Za-z]\w*|[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+|[A-Za-z_]\w*\(\))(?![\w/-])")


@dataclass
class Obj:
    kind: str  # module | class | function
    attrs: dict[str, str | None] = field(default_factory=dict)  # name → the qualified name of an indexed object
    bases: list[str] = field(default_factory=list)  # a class's bases, by simple name


class Index:
    """What the package defines, read with `ast`."""

    def __init__(self, package: Path = PACKAGE):
        self.objects: dict[str, Obj] = {}
        self.names: set[str] = set()  # every name defined anywhere: objects, attributes, parameters
        modules = {}
        for path in sorted(package.rglob("*.py")):
            parts = path.relative_to(package.parent).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
        for name in modules:
            self.objects[name] = Obj("module")
        for name in modules:  # a package's submodules are its attributes
            parent, _, leaf = name.rpartition(".")
            if parent in self.objects:
                self.objects[parent].attrs[leaf] = name
        imports = []
        for name, path in modules.items():
            self._visit(ast.parse(path.read_text(), filename=str(path)).body, name, imports)
        for owner, local, source in imports:  # `from x import y`: y is an attribute of the importing module
            self.objects[owner].attrs.setdefault(local, source if source in self.objects else None)
        self.by_name: dict[str, list[str]] = {}
        for qualified in self.objects:
            self.by_name.setdefault(qualified.rpartition(".")[2], []).append(qualified)
        self.classes = {q.rpartition(".")[2]: q for q, o in self.objects.items() if o.kind == "class"}
        # a dotted name is checked when it starts at one of these
        self.roots = {n for n, qs in self.by_name.items() if any(self.objects[q].kind != "function" for q in qs)}
        self.names |= set(self.by_name) | {a for o in self.objects.values() for a in o.attrs}

    def _visit(self, body, owner: str, imports: list, cls: str | None = None) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                qualified = f"{owner}.{node.name}"
                self.objects[owner].attrs[node.name] = qualified
                self.objects[qualified] = Obj("function")
                self.names |= {a.arg for a in ast.walk(node.args) if isinstance(a, ast.arg)}
                if cls is not None:
                    self.objects[cls].attrs.update(dict.fromkeys(_self_attributes(node)))
                self._visit(node.body, qualified, imports)
            elif isinstance(node, ast.ClassDef):
                qualified = f"{owner}.{node.name}"
                self.objects[owner].attrs[node.name] = qualified
                bases = [b.id if isinstance(b, ast.Name) else b.attr for b in node.bases
                         if isinstance(b, (ast.Name, ast.Attribute))]
                self.objects[qualified] = Obj("class", bases=bases)
                self._visit(node.body, qualified, imports, cls=qualified)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    for e in ast.walk(target):
                        if isinstance(e, ast.Name):
                            self.objects[owner].attrs.setdefault(e.id, None)
            elif isinstance(node, (ast.Import, ast.ImportFrom)) and self.objects[owner].kind == "module":
                for alias in node.names:
                    if isinstance(node, ast.ImportFrom):
                        source = f"{node.module}.{alias.name}" if node.module else alias.name
                        imports.append((owner, alias.asname or alias.name, source))
                    else:
                        imports.append((owner, alias.asname or alias.name.split(".")[0],
                                        alias.name if alias.asname else alias.name.split(".")[0]))
            elif isinstance(node, (ast.If, ast.Try, ast.With, ast.For, ast.While)):  # definitions under a guard
                nested = [*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", [])]
                nested += [n for handler in getattr(node, "handlers", []) for n in handler.body]
                self._visit(nested, owner, imports, cls)

    def attribute(self, qualified: str, name: str, seen: frozenset = frozenset()) -> tuple[bool, str | None]:
        """(whether `name` is an attribute of the object, the qualified name it leads to if indexed): own attributes,
        then those of its package base classes."""
        obj = self.objects[qualified]
        if name in obj.attrs:
            return True, obj.attrs[name]
        for base in obj.bases:
            if base in self.classes and base not in seen:
                found, child = self.attribute(self.classes[base], name, seen | {base})
                if found:
                    return found, child
        return False, None

    def resolves(self, dotted: str) -> bool:
        first, *rest = dotted.split(".")
        for start in [first] if first == PACKAGE.name else self.by_name.get(first, []):
            current = start
            for part in rest:
                found, current = self.attribute(current, part) if current else (False, None)
                if not found:
                    break
            else:
                return True
        return False


def _self_attributes(function: ast.AST) -> set[str]:
    """The `self.x` a method assigns (instance attributes)."""
    out = set()
    for node in ast.walk(function):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
        for target in targets:
            for e in ast.walk(target):
                if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self":
                    out.add(e.attr)
    return out


def config_keys(configs: Path = REPO / "configs") -> set[str]:
    """Every key path of every configs/ YAML and each of its tails (`task.sandbox.mode`, `sandbox.mode`, `mode`),
    also under the file's group (configs/method/x.yaml's `gamma` is `method.gamma`)."""
    keys = set()

    def walk(node, prefix: tuple):
        if isinstance(node, dict):
            for key, value in node.items():
                path = (*prefix, str(key))
                keys.update(".".join(path[i:]) for i in range(len(path)))
                walk(value, path)

    for path in configs.rglob("*.yaml"):
        data = yaml.safe_load(path.read_text())
        walk(data, ())
        walk(data, path.parent.relative_to(configs).parts)
    return keys


def problem(token: str, index: Index, keys: set[str], backticked: bool) -> str | None:
    """Why `token` is a code name that does not resolve, or None (it resolves, or it is not a checked code name)."""
    match = CODE.match(token.strip())
    if not match:
        return None
    name, call = match["name"], match["call"]
    parts = name.split(".")
    first = parts[0]
    if len(parts) > 1 and parts[-1] in FILE_SUFFIXES:  # a file name
        return None
    if first.startswith("_") and first.endswith("_"):  # Hydra's `_target_`, dunders
        return None
    if first in index.roots or first == PACKAGE.name:
        if index.resolves(name) or name in keys or first in EXTERNAL:
            return None
        return f"{name} does not resolve in the package"
    if len(parts) > 1:  # another library's or a variable's attribute
        return None
    camel = first[0].isupper() and any(c.islower() for c in first)
    called = call is not None and not first.isupper()  # ALL-CAPS(…) is a label: LS(E, γ), DV(E)
    checked = first.startswith("_") or (backticked and camel) or (called and (backticked or call == "()"))
    if not checked or first in index.names or first in EXTERNAL or hasattr(builtins, first):
        return None
    return f"{first} is defined nowhere in the package"


def docstrings_and_comments(path: Path):
    """(line, text) of every docstring and comment of a module."""
    source = path.read_text()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = node.body[0] if node.body else None
            if isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str):
                yield doc.lineno, doc.value.value
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string


def unresolved(markdown: list[Path], modules: list[Path], index: Index, keys: set[str]) -> list[str]:
    found = []

    def check(where: str, text: str, bare: bool) -> None:
        for m in BACKTICKED.finditer(text):
            if why := problem(m[1], index, keys, backticked=True):
                found.append(f"{where}: `{m[1]}`: {why}")
        if bare:
            for m in BARE.finditer(BACKTICKED.sub(" ", text)):
                if why := problem(m[1], index, keys, backticked=False):
                    found.append(f"{where}: {m[1]}: {why}")

    for path in markdown:
        check(str(path.relative_to(REPO)), path.read_text(), bare=False)
    for path in modules:
        for line, text in docstrings_and_comments(path):
            check(f"{path.relative_to(REPO)}:{line}", text, bare=True)
    return found


def doc_files() -> tuple[list[Path], list[Path]]:
    markdown = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted(PACKAGE.rglob("*.md"))]
    return markdown, sorted(PACKAGE.rglob("*.py"))


def test_every_code_name_in_the_docs_resolves():
    markdown, modules = doc_files()
    assert (REPO / "docs" / "design.md") in markdown
    found = unresolved(markdown, modules, Index(), config_keys())
    assert not found, "names in the docs that the package does not define:\n" + "\n".join(found)


def test_the_rule_tells_code_from_prose(tmp_path):
    """The rule on a small package: what it must flag, and what it must leave alone."""
    pkg = tmp_path / "del_bench"
    (pkg / "engine").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "engine" / "__init__.py").write_text("")
    (pkg / "engine" / "skipping.py").write_text(
        "from dataclasses import dataclass\n\n\ndef draft(engine, token):\n    pass\n\n\n"
        "@dataclass\nclass Draft:\n    early: list\n\n    def tree(self):\n        self.cached = 1\n\n\n"
        "class Sub(Draft):\n    pass\n")
    index, keys = Index(pkg), {"calibration.use", "use"}
    ok = ["del_bench.engine.skipping.draft", "skipping.draft", "engine.skipping.Draft.tree", "Draft.early",
          "Sub.cached", "Sub.tree", "draft()", "Draft(early)", "token", "calibration.use", "torch.multinomial",
          "draft.early", "limit", "E=8", "NEAR_TIE_ULPS", "LS(E4-γ4)", "_target_", "samples.jsonl",
          "python -m del_bench ls", "ValueError", "Tensor.__format__", "config.hidden_act", "x @ W"]
    bad = ["del_bench.engine.skipping._draft_skipping", "skipping._draft_skipping", "_draft_skipping", "Draft.ids",
           "Sub.missing", "del_bench.engine.decode", "draft_all()", "Verified", "engine.skipping.gone"]
    assert [t for t in ok if problem(t, index, keys, backticked=True)] == []
    assert [t for t in bad if not problem(t, index, keys, backticked=True)] == []
    # bare in a docstring: only _private names, dotted package names and name() are code; prose words stay prose
    assert problem("_draft_skipping", index, keys, backticked=False)
    assert problem("skipping.gone", index, keys, backticked=False)
    assert problem("draft_all()", index, keys, backticked=False)
    assert not problem("draft()", index, keys, backticked=False)
    assert not problem("Verified", index, keys, backticked=False)
    assert not problem("draft_all", index, keys, backticked=False)
    assert not problem("Draft(early, late)", index, keys, backticked=False)
