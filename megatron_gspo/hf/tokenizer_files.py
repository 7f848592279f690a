"""Whether a model directory holds its tokenizer, checked where one is needed (train, serve)
before anything starts.

transformers, given a directory without tokenizer files, builds an empty tokenizer from
config.json's model type without a word, so a model copied without them used to fail only at
its first prompt ("encodes to no tokens"). Convert needs none: it copies what it finds.

Light on purpose (no torch, no transformers): the launch plan checks a config with it.
"""

from __future__ import annotations

from pathlib import Path

from megatron_gspo.errors import UserError

# Any one of these lets a tokenizer load (tokenizer.json: the fast one, which the built-in
# server reads; tokenizer_config.json with its vocabulary files; tokenizer.model: sentencepiece)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
MEGATRON_META = "megatron_gspo.json"  # a Megatron checkpoint (convert's layout: model/ and hf/)


def check_tokenizer(model_dir: str | Path, key: str) -> None:
    """`model_dir` (given by `key`, e.g. "model.path"), an HF checkpoint or a Megatron one, has
    tokenizer files beside its config.json. A directory without config.json is left to the
    checks that name what it lacks."""
    path = Path(model_dir)
    hf = path / "hf" if (path / MEGATRON_META).is_file() else path
    if not (hf / "config.json").is_file():
        return
    if any((hf / name).is_file() for name in TOKENIZER_FILES):
        return
    where = f" in {hf}" if hf != path else ""
    raise UserError(
        f"{key} {path} has no tokenizer ({' / '.join(TOKENIZER_FILES)}{where}): copy the "
        "tokenizer files from the model it came from"
    )
