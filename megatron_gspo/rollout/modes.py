"""Where rollouts come from: which server (`Backend`) and where it runs (`Placement`)."""

from __future__ import annotations

from enum import StrEnum


class Backend(StrEnum):
    BUILTIN = "builtin"  # the built-in SGLang-compatible server (megatron_gspo.server)
    SGLANG = "sglang"  # SGLang itself, in its own environment


class Placement(StrEnum):
    COLOCATED = "colocated"  # servers share the trainer's GPUs (memory released while training)
    DISAGGREGATED = "disaggregated"  # servers on GPUs (or nodes) of their own
