"""`python -m megatron_gspo ...` (what torchrun -m runs): the `megatron-gspo` CLI."""

from megatron_gspo.cli import main

main()
