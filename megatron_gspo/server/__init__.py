"""The built-in SGLang-compatible rollout server: HTTP endpoints (app, control, weight_endpoints),
the engine with continuous batching, the plain-torch model with its compiled decode kernel. It
depends on `hf` for the checkpoint format and on `rollout.weight_payload` for the wire format of
weight updates, never on the Megatron side (`model`, `train`)."""
