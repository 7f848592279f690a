"""A package's re-exports, imported on first use: importing one of a package's submodules runs
its `__init__.py` first, so the torch-free parts of algo/ and routing/ (algo/config.py,
routing/modes.py, which the run config and the launch checks import) load torch only if the
package's `__init__.py` does not import the parts that use it.

    lazy_exports(__name__, {"group_advantages": "advantages", ...})   # name -> its submodule

A name is imported from its submodule when first read (`from megatron_gspo.algo import
policy_loss` as before) and kept as the package's attribute. A name that is also a submodule's
(algo's `policy_loss`) stays the re-exported object after that submodule is imported, as it did
when the package imported its parts eagerly: the import system's setting of the package's
attribute to the submodule is ignored.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any


def lazy_exports(package: str, where: dict[str, str]) -> None:
    """Make the names in `where` attributes of `package`, each imported from its submodule
    (`where` names what the package's `__all__` does, no more, no fewer)."""
    module = sys.modules[package]
    if set(where) != set(module.__all__):
        raise ValueError(f"{package}: lazy exports {sorted(where)} != __all__ {module.__all__}")
    submodules = set(where.values())

    class LazyPackage(types.ModuleType):
        def __getattr__(self, name: str) -> Any:
            if name not in where:
                raise AttributeError(f"module {package!r} has no attribute {name!r}")
            value = getattr(importlib.import_module(f"{package}.{where[name]}"), name)
            vars(self)[name] = value
            return value

        def __setattr__(self, name: str, value: Any) -> None:
            if name in submodules and name in where and isinstance(value, types.ModuleType):
                return  # the submodule of the same name, set by the import system
            super().__setattr__(name, value)

        def __dir__(self) -> list[str]:
            return sorted({*vars(self), *where})

    module.__class__ = LazyPackage
