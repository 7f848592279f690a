"""algo/ and routing/ re-export their parts' names on first use (megatron_gspo/lazy.py): every
name the packages list reads as the object its module defines, as when they imported their parts
eagerly, and importing the packages alone loads no torch."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

PACKAGES = ("megatron_gspo.algo", "megatron_gspo.routing")


def _run(code: str) -> str:
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


@pytest.mark.parametrize("package", PACKAGES)
def test_every_listed_name_is_its_modules_object(package):
    pkg = importlib.import_module(package)
    for name in pkg.__all__:
        value = getattr(pkg, name)
        defined_in = getattr(value, "__module__", None)
        if defined_in is not None and defined_in.startswith(package + "."):
            assert value is getattr(importlib.import_module(defined_in), name), name
    assert set(pkg.__all__) <= set(dir(pkg))
    with pytest.raises(AttributeError, match="no attribute 'missing'"):
        _ = pkg.missing


def test_importing_the_packages_alone_loads_no_torch():
    code = (
        "import sys, megatron_gspo.algo, megatron_gspo.routing, megatron_gspo.algo.config; "
        "print('torch' in sys.modules)"
    )
    assert _run(code) == "False"


def test_policy_loss_is_the_function_even_after_its_module_was_imported_first():
    """`megatron_gspo.algo.policy_loss` names both a module and the function it re-exports. The
    import system sets the package's attribute to the module when the module is first imported
    (train/step_parts.py imports it before train/actor.py reads the function): the package keeps
    the function, as it did when its __init__ imported the module and then the function."""
    code = (
        "import sys, megatron_gspo.algo.policy_loss\n"
        "from megatron_gspo.algo import policy_loss\n"
        "import megatron_gspo.algo as algo\n"
        "mod = sys.modules['megatron_gspo.algo.policy_loss']\n"
        "print(policy_loss is mod.policy_loss, algo.policy_loss is mod.policy_loss)"
    )
    assert _run(code) == "True True"
