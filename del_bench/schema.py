"""Typed schemas of the run config: every key of a config group declared as a field of a dataclass (Hydra's
structured configs, checked our way) — its type (a Literal for a choice), its default, what it means and its range,
beside it — and `check`, which holds a composed config against them before any weights load.

    @dataclass(kw_only=True)  # kw_only: a subclass's required keys may follow its base's defaulted ones
    class LSConfig(MethodConfig):
        exit_layer: int = key(MISSING, "E: the draft runs layers 1..E", ge=1, lt=LAYERS)

An end of a range may be a fact of the chosen model (`LAYERS`: its layer count L), so a method declares 1 ≤ E < L once
and `check` reads L from the model config (`facts`). A group whose keys depend on its choice (a method's on its
class, a model's on its source) names its schema through `schema_for`. Keys a schema does not declare are refused
with the closest declared ones ("did you mean"); a schema's `relations` checks keys against each other.

Errors are sentences that name the key, the value and what is allowed ("method.gamma=0: must be an integer ≥ 1 —
draft tokens per round"); `check` returns them all, so a config with three bad values is answered once. The same
declarations describe each key for `python -m del_bench ls` (`rows`).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from dataclasses import MISSING, dataclass
from typing import Any, Literal

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue


@dataclass(frozen=True)
class Bound:
    """An end of a range known only once the model is chosen: `facts[fact] + offset` (LAYERS - 1: L − 1)."""

    fact: str
    symbol: str
    offset: int = 0

    def __add__(self, n: int) -> Bound:
        return dataclasses.replace(self, offset=self.offset + n)

    def __sub__(self, n: int) -> Bound:
        return self + -n

    def of(self, facts: dict) -> float | None:
        value = facts.get(self.fact)
        return None if value is None else value + self.offset

    def __str__(self) -> str:
        return self.symbol + (f" − {-self.offset}" if self.offset < 0 else f" + {self.offset}" if self.offset else "")


LAYERS = Bound("num_layers", "L")  # the model's decoder layers (model.num_layers)
OPS = {"ge": ("≥", lambda v, b: v >= b), "gt": (">", lambda v, b: v > b),
       "le": ("≤", lambda v, b: v <= b), "lt": ("<", lambda v, b: v < b)}


def key(default: Any = MISSING, help: str = "", *, ge=None, gt=None, le=None, lt=None,
        pattern: tuple[str, str] | None = None, read=None) -> Any:
    """A schema field: its default (MISSING: a config must give it), what it means, its range (for a list: each
    element's; an end may be a Bound), what a string must match (`pattern`: a regular expression and the same in words)
    and `read`, how a written value is taken before the check (YAML reads a bare `off` as false)."""
    bounds = {op: end for op, end in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt)) if end is not None}
    metadata = {"help": help, "range": bounds, "pattern": pattern, "read": read}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def did_you_mean(name: str, options) -> str:
    close = difflib.get_close_matches(str(name), [str(o) for o in options], n=3, cutoff=0.5)
    return f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


# ---- types ------------------------------------------------------------------------------------------------------
def _args(tp) -> tuple:
    return typing.get_args(tp)


def _is_union(tp) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType)


def _is_schema(tp) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _conforms(value, tp) -> bool:
    """Whether a resolved value is of type `tp` (int is not bool; a float key takes an int)."""
    if tp is Any:
        return True
    if tp is type(None):
        return value is None
    if _is_union(tp):
        return any(_conforms(value, arg) for arg in _args(tp))
    if typing.get_origin(tp) is Literal:
        return any(value == arg and type(value) is type(arg) for arg in _args(tp))
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if typing.get_origin(tp) is list or tp is list:
        return isinstance(value, list) and all(_conforms(v, (_args(tp) or (Any,))[0]) for v in value)
    if typing.get_origin(tp) is dict or tp is dict or _is_schema(tp):
        return isinstance(value, dict)
    return isinstance(value, tp)


def type_text(tp, pattern: tuple[str, str] | None = None) -> str:
    """`tp` in words: an integer, one of auto, on, off, a list of integers, …, or null (a string: `pattern`'s words)."""
    if tp is str and pattern:
        return pattern[1]
    if _is_union(tp):
        others = [arg for arg in _args(tp) if arg is not type(None)]
        words = " or ".join(type_text(arg, pattern) for arg in others)
        return f"{words}, or null" if len(others) < len(_args(tp)) else words
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(str(arg) for arg in _args(tp))
    if typing.get_origin(tp) is list or tp is list:
        inner = (_args(tp) or (Any,))[0]
        return "a list" if inner is Any else f"a list of {_plural(type_text(inner))}"
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string", Any: "anything",
             dict: "a mapping"}
    return names.get(tp, names.get(typing.get_origin(tp), "a mapping" if _is_schema(tp) else str(tp)))


def _plural(words: str) -> str:
    return {"an integer": "integers", "a number": "numbers", "a string": "strings"}.get(words, words)


def _whole(bounds: dict) -> dict:
    """An integer's open ends as closed ones: < L is ≤ L − 1, > 0 is ≥ 1."""
    shifted = {"lt": ("le", -1), "gt": ("ge", 1)}
    return {shifted[op][0] if op in shifted else op: end + shifted[op][1] if op in shifted else end
            for op, end in bounds.items()}


def range_text(bounds: dict, facts: dict | None = None) -> str:
    """[1, L − 1], ≥ 1, (0, 1] — and with the model's facts, what that is here: [1, L − 1], here [1, 3] (L = 4)."""
    if not bounds:
        return ""
    low = next(((op, bounds[op]) for op in ("ge", "gt") if op in bounds), None)
    high = next(((op, bounds[op]) for op in ("le", "lt") if op in bounds), None)
    if low and high:
        text = f"in {'[' if low[0] == 'ge' else '('}{low[1]}, {high[1]}{']' if high[0] == 'le' else ')'}"
    else:
        op, end = low or high
        text = f"{OPS[op][0]} {end}"
    symbolic = {op: end for op, end in bounds.items() if isinstance(end, Bound)}
    if symbolic and facts and all(end.of(facts) is not None for end in symbolic.values()):
        here = {op: end.of(facts) if isinstance(end, Bound) else end for op, end in bounds.items()}
        values = ", ".join(sorted({f"{end.symbol} = {facts[end.fact]}" for end in symbolic.values()}))
        text += f", here {range_text(here).removeprefix('in ')} ({values})"
    return text


def allowed_text(tp, bounds: dict, facts: dict | None = None, pattern: tuple[str, str] | None = None) -> str:
    """What a key accepts, in words: 'an integer in [1, L − 1]', 'a list of integers, each ≥ 1'."""
    integers = {int, int | None, list[int], list[int] | None}
    words, within = type_text(tp, pattern), range_text(_whole(bounds) if tp in integers else bounds, facts)
    if not within:
        return words
    words, null = words.removesuffix(", or null"), ", or null" if words.endswith(", or null") else ""
    listed = typing.get_origin(tp) is list or (_is_union(tp) and any(typing.get_origin(a) is list for a in _args(tp)))
    return f"{words}{', each' if listed else ''} {within}{null}"


# ---- checking ---------------------------------------------------------------------------------------------------
def _out_of_range(value, bounds: dict, facts: dict) -> bool:
    """Whether a number (or any number of a list) lies outside the range; ends not known yet are not checked."""
    if isinstance(value, list):
        return any(_out_of_range(v, bounds, facts) for v in value)
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    for op, end in bounds.items():
        end = end.of(facts) if isinstance(end, Bound) else end
        if end is not None and not OPS[op][1](value, end):
            return True
    return False


def shown(value) -> str:
    """A value as the command line writes it: 'x' for a string, null, true, [1, 2]."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return repr(value) if isinstance(value, str) else str(value)


def resolver_error(err: BaseException) -> str:
    """An interpolation's error without OmegaConf's decoration (a resolver's ConfigError reads as itself)."""
    text = str(err).split("\n    full_key:")[0]
    return re.sub(r"^\w+ raised while resolving interpolation: ", "", text)


def _read(node, name: str, nested: bool):
    """node[name], resolved; a list or mapping as plain Python, but a nested schema's mapping stays a node (its keys
    are read one by one)."""
    value = node[name]
    if isinstance(value, ListConfig) or (isinstance(value, DictConfig) and not nested):
        return OmegaConf.to_container(value, resolve=True)
    return value


def _problem(value, field: dataclasses.Field, tp, facts: dict) -> str | None:
    """Why a resolved value is not allowed for `field`, or None."""
    bounds, pattern = field.metadata.get("range", {}), field.metadata.get("pattern")
    fits = _conforms(value, tp) and not _out_of_range(value, bounds, facts)
    if fits and not (pattern and isinstance(value, str) and not re.fullmatch(pattern[0], value)):
        return None
    meaning = field.metadata.get("help", "")
    because = f"must be {allowed_text(tp, bounds, facts, pattern)}" + (f" — {meaning}" if meaning else "")
    choices = [a for arg in (_args(tp) if _is_union(tp) else (tp,)) if typing.get_origin(arg) is Literal
               for a in _args(arg)]
    guess = did_you_mean(value, choices) if isinstance(value, str) and choices else ""
    return because + (f".{guess}" if guess else "")


def check(schema: type, node, where: str = "", facts: dict | None = None) -> list[str]:
    """Every problem of config node `node` (a DictConfig or a dict) against dataclass `schema`, each a sentence naming
    `where`.key; [] when it conforms. facts: what ranges may be bounded by (num_layers)."""
    facts = facts or {}
    if "schema_for" in vars(schema):  # a group whose keys depend on its choice: the chosen one's schema
        try:
            schema = schema.schema_for(node)
        except Exception as err:  # noqa: BLE001 — a _target_ that does not import, …: nothing else can be checked
            return [f"{where or 'the config'}: cannot tell which keys it takes: {resolver_error(err)}"]
    hints = typing.get_type_hints(schema)
    declared = {f.name: f for f in dataclasses.fields(schema)}
    prefix = f"{where}." if where else ""
    problems = [f"{prefix}{name}: {_unknown(node, where, name, declared)}" for name in node if name not in declared]
    values = {}
    for name, field in declared.items():
        path = prefix + name
        meaning = field.metadata.get("help") or allowed_text(hints[name], {})
        required = field.default is MISSING and field.default_factory is MISSING
        tp, inner = hints[name], _schema_of(hints[name])
        try:  # `in` is false for ??? too
            value = _read(node, name, inner is not None) if name in node or required else MISSING
        except MissingMandatoryValue:
            value = MISSING
        except Exception as err:  # noqa: BLE001 — a resolver's error (a missing file, a bad calibration): say which key
            problems.append(Unresolved(path, resolver_error(err), field.metadata.get("help", "")))
            continue
        if value is MISSING:
            problems.extend([f"{path}: missing — give {path}=…: {meaning}"] * required)
            continue
        read = field.metadata.get("read")
        value = read(value) if read else value
        if inner is not None and isinstance(value, (DictConfig, dict)):
            problems.extend(check(inner, value, path, facts))
            continue
        problem = _problem(value, field, tp, facts)
        if problem:
            problems.append(f"{path}={shown(value)}: {problem}")
        values[name] = value
    if not problems and hasattr(schema, "relations"):  # keys against each other: sentences naming their keys
        problems.extend(schema.relations(values, facts))
    return _root_causes(problems)


class Unresolved(str):
    """A key whose interpolation fails: '<keys>: cannot be resolved: <the resolver's error>', and, for one key, what
    it means (where a default comes from: calibrate's grid from the model's entry)."""

    def __new__(cls, keys: str, cause: str, meaning: str = ""):
        text = f"{keys}: cannot be resolved: {cause}" + (f" ({meaning})" if meaning else "")
        problem = super().__new__(cls, text)
        problem.keys, problem.cause = keys, cause
        return problem


def _root_causes(problems: list[str]) -> list[str]:
    """The problems, each cause once: none that only follows from a missing key reported among them (model.path
    missing: not also model.name and out_dir, which interpolate it), and keys that fail to resolve for the same reason
    (a calibration file without the task: method.exit_layer, method.gamma, out_dir) named together."""
    missing = {p.split(":")[0] for p in problems if ": missing — " in p}
    problems = [p for p in problems if not any(f"Missing mandatory value: {k}" in p for k in missing)]
    keys: dict[str, list[str]] = {}
    for problem in problems:
        if isinstance(problem, Unresolved):
            keys.setdefault(problem.cause, []).append(problem.keys)
    kept = []
    for problem in problems:
        if not isinstance(problem, Unresolved):
            kept.append(problem)
        elif len(keys[problem.cause]) == 1:
            kept.append(problem)
        elif keys[problem.cause][0] == problem.keys:  # the first of several: all of them, once
            kept.append(Unresolved(", ".join(keys[problem.cause]), problem.cause))
    return kept


def _schema_of(tp) -> type | None:
    """The dataclass a field nests (`Sampling`, `Sampling | None`), or None for a leaf."""
    options = [arg for arg in (_args(tp) if _is_union(tp) else (tp,)) if _is_schema(arg)]
    return options[0] if options else None


def _unknown(node, where: str, name: str, declared: dict) -> str:
    """A key the schema does not declare: of which config, what was probably meant, which keys there are."""
    keys = [k for k in declared if not k.startswith("_")]
    try:
        chosen = node.get("name") if where else None  # the group's choice: "method ls"
    except Exception:  # noqa: BLE001 — a name that does not resolve is reported as its own key's problem
        chosen = None
    what = f"{where} {chosen}" if isinstance(chosen, str) else where or "the run config"
    return f"not a key of {what}.{did_you_mean(name, keys)} Its keys: {', '.join(keys)}"


# ---- describing -------------------------------------------------------------------------------------------------
def rows(schema: type, defaults=None, prefix: str = "", given: bool = True) -> list[tuple[str, str, str, str]]:
    """(key, accepts, default, meaning) of every key of `schema`, nested schemas' keys dotted; `defaults`: the config
    whose values to show as defaults (the YAML's, interpolations as written), else the schema's; given=False: a
    nested mapping the config leaves out (calibrate's `grid` in a run), whose required keys are shown unset."""
    hints = typing.get_type_hints(schema)
    out = []
    for field in dataclasses.fields(schema):
        if field.name.startswith("_"):
            continue
        written = _written(defaults, field)
        inner = _schema_of(hints[field.name])
        if inner is not None and not field.metadata.get("help"):
            nested = written if isinstance(written, dict) else None
            out.extend(rows(inner, nested, f"{prefix}{field.name}.", given and nested is not None))
            continue
        accepts = allowed_text(hints[field.name], field.metadata.get("range", {}), None, field.metadata.get("pattern"))
        default = _default_text(written) if given or written is not MISSING else "(unset)"
        out.append((prefix + field.name, accepts, default, field.metadata.get("help", "")))
    return out


def _written(defaults, field: dataclasses.Field):
    if isinstance(defaults, dict) and field.name in defaults:
        return defaults[field.name]
    if field.default is not MISSING:
        return field.default
    return field.default_factory() if field.default_factory is not MISSING else MISSING


def _default_text(value) -> str:
    if value is MISSING or value == "???":
        return "(required)"
    if isinstance(value, str) and "${" in value and len(value) > 60:
        return "(derived from other keys)"  # decoding, out_dir: their expression is configs/run.yaml's
    if isinstance(value, str):
        return value or '""'
    return shown(value) if not isinstance(value, dict) else "{…}"
