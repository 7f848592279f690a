"""The CPU compatibility layer is applied only by a CPU run's set-up, never on import."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit


def run(code: str, expect: str) -> None:
    """Run `code` in a fresh interpreter (the patches are process-wide); it must succeed and
    print `expect`."""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert expect in proc.stdout


def test_importing_the_model_code_does_not_patch_torch():
    run(
        "import sys, torch\n"
        "import megatron_gspo.model.builder, megatron_gspo.model.policy, megatron_gspo.cli\n"
        "assert 'megatron_gspo.model.cpu_compat' not in sys.modules\n"
        "try:\n    torch.cuda.current_device()\nexcept Exception:\n    print('untouched')\n",
        "untouched",
    )


def test_cpu_setup_applies_it_and_redirects_cuda_calls():
    run(
        "import torch\n"
        "from megatron_gspo.model.parallel import ParallelDims, init_distributed\n"
        "init_distributed(ParallelDims())\n"
        "from megatron_gspo.model import cpu_compat\n"
        "assert cpu_compat.is_applied()\n"
        "assert torch.cuda.current_device() == torch.device('cpu')\n"
        "assert torch.zeros(2).cuda().device.type == 'cpu'\n"
        "from megatron.core.transformer.utils import get_default_causal_mask\n"
        "assert get_default_causal_mask(3).device.type == 'cpu'\n"
        "from megatron.core.tensor_parallel.random import get_cuda_rng_tracker\n"
        "with get_cuda_rng_tracker().fork():\n    a = torch.rand(3)\n"
        "print('ok')\n",
        "ok",
    )


def test_without_te_fixes_apply_on_any_device_and_router_gating_runs():
    """The megatron-core bugs that bite without Transformer Engine are mended by their own module
    (a GPU machine without TE needs them too, and never imports cpu_compat)."""
    run(
        "import sys, torch\n"
        "from megatron_gspo.model import without_te\n"
        "without_te.apply()\n"
        "assert 'megatron_gspo.model.cpu_compat' not in sys.modules\n"
        "from megatron.core.transformer.moe import moe_utils\n"
        "from megatron.core.tensor_parallel.random import CheckpointWithoutOutput\n"
        "x, w = torch.randn(4, 8), torch.randn(3, 8)\n"
        "y = moe_utils.router_gating_linear(x, w, None, torch.float32)\n"
        "assert torch.allclose(y, x @ w.T, atol=1e-5), (y, x @ w.T)\n"
        "assert CheckpointWithoutOutput(fp8=False).fp8 is False\n"
        "print('ok')\n",
        "ok",
    )
