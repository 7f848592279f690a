"""HF -> Megatron checkpoint conversion; same as `megatron-gspo convert hf-to-megatron`.

torchrun --nproc-per-node N tools/convert_hf_to_megatron.py --hf DIR --out DIR [--tp N --pp N --ep N --etp N]
"""

import sys

from megatron_gspo.cli import main

if __name__ == "__main__":
    main(["convert", "hf-to-megatron", *sys.argv[1:]])
