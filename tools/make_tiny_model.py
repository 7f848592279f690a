"""Write a tiny random HF checkpoint (Qwen3-MoE by default) with a locally built tokenizer.

python tools/make_tiny_model.py --out /tmp/tiny-moe [--hidden 64 --layers 2 --experts 8 ...]
"""

import sys

from megatron_gspo.cli import main

if __name__ == "__main__":
    main(["make-tiny-model", *sys.argv[1:]])
