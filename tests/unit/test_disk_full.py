"""What a full disk comes out as, and that disk_full.py finds it there: torch's zip writer turns
the file's ENOSPC into its own "unexpected pos" error (the OSError left as its context); an
OSError Python raises is itself. The ENOSPC is a fault injected at the file's `write`."""

from __future__ import annotations

import errno
import io
import os

import pytest
import torch

from megatron_gspo.disk_full import disk_full, full_line, hidden_os_error

pytestmark = pytest.mark.unit


class FillingFile(io.BytesIO):
    """A file on a disk that fills under it: its first write goes, each after raises ENOSPC."""

    writes = 0

    def write(self, data) -> int:
        self.writes += 1
        if self.writes > 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return super().write(data)


def test_torch_hides_the_enospc_of_its_write_and_it_is_found_behind_its_error(tmp_path):
    with pytest.raises(RuntimeError, match="unexpected pos") as raised:
        torch.save(torch.arange(1000), FillingFile())
    hidden = hidden_os_error(raised.value)
    assert hidden is not None and hidden.errno == errno.ENOSPC
    assert disk_full(raised.value, tmp_path)  # (this disk has room: the errno says it)


def test_other_errors_are_not_a_full_disk(tmp_path):
    assert not disk_full(OSError(errno.EACCES, "Permission denied"), tmp_path)
    assert not disk_full(RuntimeError("unexpected pos 704 vs 598"), tmp_path)  # (room there)
    assert not disk_full(ValueError("no"), tmp_path)
    assert disk_full(OSError(errno.ENOSPC, "No space left on device"), tmp_path)


def test_the_line_names_the_disk_the_write_and_what_to_resume_from(tmp_path):
    line = full_line(tmp_path, "checkpoint step_3", tmp_path / "step_2")
    assert line.startswith(f"the disk holding {tmp_path} is full (") and " MiB free) " in line
    assert line.endswith("writing checkpoint step_3; free space (step_2, the last complete "
                         "checkpoint, is intact) and rerun with --resume")  # fmt: skip
    fresh = full_line(tmp_path, "metrics.jsonl", None)
    assert fresh.endswith("free space and run the same command again (the run has no "
                          "checkpoint yet)")  # fmt: skip
