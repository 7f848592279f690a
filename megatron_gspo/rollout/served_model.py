"""Whether the servers someone else started (`rollout.urls`) serve the model being trained.

A server of another model answers /generate as well as one of this model: its token ids come
from another vocabulary, and the run would train on them without a word. At start the trainer
asks each server what it serves (/model_info; /get_model_info, its older name) and refuses, in
one line, only where the answer certainly differs from the model trained, by its vocabulary
size: the one the server reports (the built-in server does; SGLang does not), else the one in
config.json at the model path it reports, where that is an absolute path to a checkpoint
directory readable here (a shared filesystem). The path alone decides nothing: a copy of the
model elsewhere is the same model, and a server's model path follows its loads from disk (the
servers of a resumed run report the last run's weights directory). A server that does not
answer (an older one), or says nothing to compare (a model path that is a hub name, or on
another machine), is not checked.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp

from megatron_gspo.rollout.answers import RolloutError

if TYPE_CHECKING:
    from megatron_gspo.rollout.client import RolloutClient

INFO_PATHS = ("/model_info", "/get_model_info")  # (SGLang's name now, and its older one)
_ASK = aiohttp.ClientTimeout(total=10)
_CONFIG_LIMIT = 1 << 20  # a config.json is a few KB


async def check_served_models(client: RolloutClient, trained: Path, vocab_size: int) -> None:
    """A RolloutError (one line) naming the first of `client`'s servers that serves a model
    whose vocabulary is not `vocab_size`, the one of `trained` (the model being trained)."""
    for url in client.urls:
        info = await model_info(client, url)
        if info is None:
            continue
        served = info.get("model_path")
        name = served[:300] if isinstance(served, str) and served else "a model"
        vocab = served_vocab(info)
        if vocab is not None and vocab != vocab_size:
            raise RolloutError(
                f"{url} serves {name} (a vocabulary of {vocab} tokens), not the model being "
                f"trained, {trained} ({vocab_size} tokens): its token ids would be another "
                f"vocabulary's; point rollout.urls at servers of {trained}"
            )


async def model_info(client: RolloutClient, url: str) -> dict | None:
    """`url`'s answer to /model_info (else /get_model_info); None where it gives neither."""
    for path in INFO_PATHS:
        try:
            return await client.get(url, path, _ASK)
        except (RolloutError, aiohttp.ClientError, TimeoutError):
            continue
    return None


def served_vocab(info: dict) -> int | None:
    """The vocabulary size of the model a server's model info `info` describes: the one it
    says, else config.json's at its model path (absolute, readable here); None: unknown."""
    said = info.get("vocab_size")
    if type(said) is int and said > 0:
        return said
    path = info.get("model_path")
    return config_vocab(Path(path)) if isinstance(path, str) and os.path.isabs(path) else None


def config_vocab(checkpoint: Path) -> int | None:
    """The vocab_size in `checkpoint`/config.json; None where there is no such file here, or it
    says none."""
    config = checkpoint / "config.json"
    try:
        if not config.is_file():  # (not a FIFO, which a read would wait on)
            return None
        with open(config, "rb") as f:
            data = json.loads(f.read(_CONFIG_LIMIT))
    except (OSError, ValueError, RecursionError):
        return None
    vocab = data.get("vocab_size") if isinstance(data, dict) else None
    return vocab if type(vocab) is int and vocab > 0 else None
