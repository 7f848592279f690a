"""GPU tier: a bucket sent as CUDA IPC handles opens in another process the way SGLang's
receivers open it, by the device's UUID (its CUDA_VISIBLE_DEVICES may number GPUs otherwise)."""

import os
import subprocess
import sys

import pytest
import torch

from megatron_gspo.rollout import weight_payload as wp

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# The receiver: unpickle with rebuild_cuda_tensor's device argument mapped from a UUID to this
# process's index of that GPU (what SGLang's patched reductions do), then print the bytes' sum.
RECEIVER = """
import base64, io, pickle, sys, torch
from torch.multiprocessing import reductions
def rebuild(*args):
    uuid = args[6]
    assert isinstance(uuid, str), f"device sent as {uuid!r}, not a UUID"
    idx = [i for i in range(torch.cuda.device_count())
           if str(torch.cuda.get_device_properties(i).uuid) == uuid]
    assert idx, f"no visible GPU has UUID {uuid}"
    return reductions.rebuild_cuda_tensor(*args[:6], idx[0], *args[7:])
class U(pickle.Unpickler):
    def find_class(self, module, name):
        if name == "rebuild_cuda_tensor":
            return rebuild
        return super().find_class(module, name)
obj = U(io.BytesIO(base64.b64decode(sys.stdin.read()))).load()
t = obj["flattened_tensor"]
print(int(t.to(torch.int64).sum()), t.device.index)
"""


def test_cuda_bucket_opens_in_another_process_by_device_uuid():
    dev = torch.cuda.device_count() - 1  # the last GPU: index 0 in the receiver below
    flat = torch.randint(0, 255, (1 << 20,), dtype=torch.uint8, device=f"cuda:{dev}")
    payload = wp.serialize({"flattened_tensor": flat, "metadata": []})
    uuid = str(torch.cuda.get_device_properties(dev).uuid)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(dev)}
    proc = subprocess.run([sys.executable, "-c", RECEIVER], input=payload, text=True,
                          capture_output=True, env=env, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    total, index = map(int, proc.stdout.split())
    assert total == int(flat.to(torch.int64).sum()) and index == 0, (uuid, proc.stdout)
