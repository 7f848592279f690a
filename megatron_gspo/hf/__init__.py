"""HF formats: config.json (`config`), safetensors shards (`io`) and the tiny local models and
tokenizer (`tiny`). Imported by the Megatron side, the server, the weight sync and the data code;
imports none of them."""
