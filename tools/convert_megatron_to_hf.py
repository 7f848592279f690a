"""Megatron -> HF checkpoint conversion; same as `megatron-gspo convert megatron-to-hf`.

torchrun --nproc-per-node N tools/convert_megatron_to_hf.py --megatron DIR --out DIR [--tp N --pp N --ep N --etp N]
"""

import sys

from megatron_gspo.cli import main

if __name__ == "__main__":
    main(["convert", "megatron-to-hf", *sys.argv[1:]])
