"""Installed as sitecustomize.py into the contract-test SGLang venv ONLY (scripts/sglang_env.sh).

Two CUDA-only calls that SGLang 0.5.23 makes even with --device cpu, made no-ops when no CUDA
device is present (on a GPU host nothing is patched):
  1. cudaHostRegister of the host buffer for routed experts (--enable-return-routed-experts):
     the scheduler dies with "Found no NVIDIA driver".
  2. the device synchronize at the end of /release_memory_occupation: same error.
The patches are applied lazily, right after the module that holds each call is imported, so
other Python programs run in this venv (pip, ...) pay nothing.
"""

import importlib.abc
import sys


def _no_cuda() -> bool:
    import torch

    return not torch.cuda.is_available()


def _patch_host_register(module) -> None:
    if _no_cuda():
        module._cuda_host_register = lambda buffer, *args, **kwargs: None


def _patch_release_memory(module) -> None:
    if not _no_cuda():
        return
    import torch

    cls = module.SchedulerWeightUpdaterManager
    original = cls.release_memory_occupation

    def release_memory_occupation(self, recv_req):
        synchronize = torch.cuda.synchronize
        torch.cuda.synchronize = lambda *args, **kwargs: None
        try:
            return original(self, recv_req)
        finally:
            torch.cuda.synchronize = synchronize

    cls.release_memory_occupation = release_memory_occupation


_PATCHES = {
    "sglang.srt.mem_cache.pool_host.common": _patch_host_register,
    "sglang.srt.managers.scheduler_components.weight_updater": _patch_release_memory,
}


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in _PATCHES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                break
        else:
            return None
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _PATCHES[name](module)

        spec.loader.exec_module = exec_and_patch
        return spec


sys.meta_path.insert(0, _PatchAfterImport())
