"""Methods: one policy file each here, plus one configs/method/*.yaml.

`method_class(name)` finds the class of a run's method from the name its records keep (RunKey.method, the config's
`name:`), so readers of records — `show`, the report, the benches — take a method's label, family and order from the
method itself (Method.table_label, …) without an instance or a model. Classes register under their names when they
are defined (Method.__init_subclass__); a name not registered yet is looked for by importing every module of this
package — the peers too (peers.py: transformers' own decoding as rows beside ours).
"""

from __future__ import annotations

import functools
import importlib
import pkgutil


def method_class(name: str) -> type | None:
    """The Method subclass that runs under config name `name`, or None where no class says it does (records of a
    method whose module this process cannot find: readers then show its name as it is)."""
    from del_bench.methods.base import REGISTRY

    if name not in REGISTRY:
        _import_all()
    return REGISTRY.get(name)


@functools.cache
def _import_all() -> None:
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")
