"""A reward function from the user's code: "package.module:function" or "path/to/file.py:function".

Loading imports exactly the named module (a file path is imported as a module of its own, under
a private name, once per process: its functions named by two specs are the same objects) and
nothing else (`import_user_module`, with which env.fn and env.tools load their code too); the
function must be callable as fn(prompt, response, answer).
Training loads it in a bounded worker process (megatron_gspo/bounded), never in the trainer, so
that a module which exits, hangs or kills its process when imported fails the load alone.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from pathlib import Path

from megatron_gspo.errors import UserError


def _import_file(spec: str, path: Path, kind: str):
    if not path.is_file():
        raise UserError(f"{kind} {spec!r}: file {str(path)!r} does not exist")
    name = f"_megatron_gspo_user_{abs(hash(str(path.resolve())))}"
    if name in sys.modules:  # (imported already: another of its functions)
        return sys.modules[name]
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


def _import_fix(module_name: str, missing: str | None) -> str:
    """What to do about the module `missing` that importing `module_name` did not find: the
    plugin's own package, a module beside its file (a file is imported alone, as a module of
    its own: its folder is not on the path), or a package to install."""
    if missing is not None and (module_name + ".").startswith(missing + "."):
        return "put its package on PYTHONPATH or give the path of a .py file"
    top = (missing or "").partition(".")[0]
    folder = Path(module_name).parent if module_name.endswith(".py") else None
    if top and folder is not None and ((folder / f"{top}.py").is_file() or (folder / top).is_dir()):
        return (
            f"it imports {top!r} from its own folder: put {str(folder.resolve())!r} on PYTHONPATH"
        )
    return f"install {missing!r}, which it imports"


def import_user_module(spec: str, module_name: str, kind: str):
    """The module `module_name` ("package.module", or "path/to/file.py") that `spec` names, or
    a one-line UserError naming `kind` and `spec` and what to do."""
    try:
        if module_name.endswith(".py"):
            return _import_file(spec, Path(module_name), kind)
        return importlib.import_module(module_name)
    except UserError:
        raise
    except ModuleNotFoundError as e:
        fix = _import_fix(module_name, e.name)
        raise UserError(f"{kind} {spec!r}: cannot import {module_name!r} ({e}); {fix}") from e
    except BaseException as e:  # (SystemExit and KeyboardInterrupt raised by the module too)
        raised = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        raise UserError(f"{kind} {spec!r}: importing {module_name!r} raised {raised}") from e


def _check_call(spec: str, fn: Callable, args: int, kind: str, usage: str) -> None:
    """`fn` takes `args` positional arguments, or a UserError naming the form it must have."""
    try:
        signature = inspect.signature(fn)
    except (ValueError, TypeError):  # (no signature to read, a builtin's: its calls will tell)
        return
    try:
        signature.bind(*range(args))
    except TypeError as e:
        raise UserError(
            f"{kind} {spec!r}: it takes {signature} ({e}); it must be callable as {usage}"
        ) from None


def load_plugin(
    spec: str,
    kind: str = "reward plugin",
    usage: str = "fn(prompt, response, answer) -> float",
    args: int = 3,
) -> Callable:
    """The callable named by `spec` ("module:name"), callable with `args` positional arguments;
    `kind` and `usage` word its errors."""
    module_name, _, attr = spec.rpartition(":")
    if not module_name or not attr:
        raise UserError(f"{kind} {spec!r}: write it as module:function or file.py:function")
    module = import_user_module(spec, module_name, kind)
    fn = getattr(module, attr, None)
    if fn is None:
        raise UserError(f"{kind} {spec!r}: {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise UserError(
            f"{kind} {spec!r}: {attr!r} is a {type(fn).__name__}, not callable; it must be "
            f"callable as {usage}"
        )
    _check_call(spec, fn, args, kind, usage)
    return fn


def loading_failed(what: str, why: str, raised: bool) -> str:
    """The one line of a plugin (`what`) that a worker process could not load: `why` as the load
    raised it (`raised`: load_plugin's own line), else the worker exited, hung or was killed while
    importing it."""
    if raised:
        return why
    return (f"{what} could not be loaded: {why}; its module must import without exiting, "
            "hanging or ending its process")  # fmt: skip
