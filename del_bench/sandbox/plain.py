"""Plain data across the sandbox's pipes: what a program's function may return, and what the judge rebuilds from it.

Both sides use these two functions (the worker and the judge get their source, del_bench/sandbox/worker.py and
judge.py): the program's side encodes whatever its function returned (coercing int / float / str subclasses and
numbers.Integral / Real, such as numpy's, to the value `==` would compare), the judge decodes strictly into fresh
builtin objects. JSON carries None, bool, int, float, str and list as they are; tuples, sets, frozensets, dicts and
ints beyond 64 bits are tagged (a one-key object). Anything else is refused. They import nothing at module level:
their source is sent to processes that import nothing of this checkout.
"""

from __future__ import annotations


def encode(value):
    """`value` as JSON-ready plain data; TypeError for anything else (functions, objects, generators)."""
    import numbers

    kind = type(value)
    if value is None or kind is bool:
        return value
    if issubclass(kind, int):
        value = int.__int__(value)
        return value if -(1 << 63) <= value < (1 << 63) else {"int": hex(value)}
    if issubclass(kind, float):
        return float.__float__(value)
    if issubclass(kind, str):
        return str.__str__(value)
    if issubclass(kind, list):
        return [encode(v) for v in list.__iter__(value)]
    for tag, base in (("tuple", tuple), ("set", set), ("frozenset", frozenset)):
        if issubclass(kind, base):
            return {tag: [encode(v) for v in base.__iter__(value)]}
    if issubclass(kind, dict):
        return {"dict": [[encode(k), encode(v)] for k, v in dict.items(value)]}
    if isinstance(value, numbers.Integral) and not isinstance(value, type):
        return encode(int(value))
    if isinstance(value, numbers.Real) and not isinstance(value, type):
        return float(value)
    raise TypeError(f"a {kind.__name__} is not plain data")


def decode(data):
    """The value `encode` made: builtin objects only; ValueError for anything `encode` cannot have made."""
    kind = type(data)
    if data is None or kind in (bool, int, float, str):
        return data
    if kind is list:
        return [decode(v) for v in data]
    if kind is dict and len(data) == 1:
        ((tag, body),) = data.items()
        if tag == "int" and type(body) is str:
            return int(body, 16)
        if type(body) is list:
            if tag == "tuple":
                return tuple(decode(v) for v in body)
            if tag == "set":
                return {decode(v) for v in body}
            if tag == "frozenset":
                return frozenset(decode(v) for v in body)
            if tag == "dict" and all(type(p) is list and len(p) == 2 for p in body):
                return {decode(k): decode(v) for k, v in body}
    raise ValueError(f"not an encoded value: {str(data)[:80]}")
