"""A reward function from the user's code: "package.module:function" or "path/to/file.py:function".

Loading imports exactly the named module (a file path is imported as a module of its own, under
a private name) and nothing else; the function must be callable as fn(prompt, response, answer).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

from megatron_gspo.errors import UserError


def _import_file(spec: str, path: Path, kind: str):
    if not path.is_file():
        raise UserError(f"{kind} {spec!r}: file {str(path)!r} does not exist")
    name = f"_megatron_gspo_reward_{abs(hash(str(path.resolve())))}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise UserError(f"{kind} {spec!r}: {str(path)!r} is not a Python file")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _import(spec: str, module_name: str, kind: str):
    try:
        if module_name.endswith(".py"):
            return _import_file(spec, Path(module_name), kind)
        return importlib.import_module(module_name)
    except UserError:
        raise
    except ModuleNotFoundError as e:
        named = e.name is not None and (module_name + ".").startswith(e.name + ".")
        fix = (
            "put its package on PYTHONPATH or give the path of a .py file"
            if named
            else f"install {e.name!r}, which it imports"
        )
        raise UserError(f"{kind} {spec!r}: cannot import {module_name!r} ({e}); {fix}") from e
    except Exception as e:
        raise UserError(
            f"{kind} {spec!r}: importing {module_name!r} raised {type(e).__name__}: {e}"
        ) from e


def load_plugin(
    spec: str, kind: str = "reward plugin", usage: str = "fn(prompt, response, answer) -> float"
) -> Callable:
    """The callable named by `spec` ("module:name"); `kind` and `usage` word its errors."""
    module_name, _, attr = spec.rpartition(":")
    if not module_name or not attr:
        raise UserError(f"{kind} {spec!r}: write it as module:function or file.py:function")
    module = _import(spec, module_name, kind)
    fn = getattr(module, attr, None)
    if fn is None:
        raise UserError(f"{kind} {spec!r}: {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise UserError(
            f"{kind} {spec!r}: {attr!r} is a {type(fn).__name__}, not callable; it must be "
            f"callable as {usage}"
        )
    return fn
