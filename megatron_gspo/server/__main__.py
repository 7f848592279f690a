"""`python -m megatron_gspo.server --model HF_DIR --port 0`: the built-in server (see app.py)."""

from megatron_gspo.server.serve import main

main()
