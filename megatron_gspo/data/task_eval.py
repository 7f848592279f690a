"""Greedy and sampled completions of a batch of prompts with an HF causal LM, and their rewards.

Plain torch, no KV cache: the prompts here are ~10 tokens and the answers ~3, so recomputing the
whole (left-padded) batch for each new token costs less than managing a cache. Used to build and
check the task's starting checkpoint; the RL loop evaluates through its rollout servers.
"""

from __future__ import annotations

import torch

from megatron_gspo.data.prompts import PromptRow, encode_prompt
from megatron_gspo.rewards import RewardFn, score_rewards


def _left_pad(seqs: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    length = max(map(len, seqs))
    ids = torch.full((len(seqs), length), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), length), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, length - len(s) :] = torch.tensor(s)
        mask[i, length - len(s) :] = 1
    return ids, mask


def last_logits(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Logits of the next token after each left-padded row; positions count real tokens only."""
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -1].float()


@torch.no_grad()
def complete(
    model,
    prompts: list[list[int]],
    eos: int,
    pad: int,
    max_new_tokens: int = 8,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> list[list[int]]:
    """New tokens of each prompt, up to and including EOS (greedy when temperature is 0)."""
    ids, mask = _left_pad(prompts, pad)
    done = torch.zeros(len(prompts), dtype=torch.bool)
    out: list[list[int]] = [[] for _ in prompts]
    for _ in range(max_new_tokens):
        logits = last_logits(model, ids, mask)
        if temperature == 0:
            nxt = logits.argmax(-1)
        else:
            probs = torch.softmax(logits / temperature, -1)
            nxt = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        for i in (~done).nonzero().flatten().tolist():
            out[i].append(int(nxt[i]))
        ids = torch.cat([ids, nxt[:, None]], 1)
        mask = torch.cat([mask, (~done).long()[:, None]], 1)
        done |= nxt == eos
        if bool(done.all()):
            break
    return out


def task_rewards(
    model,
    tokenizer,
    rows: list[PromptRow],
    reward: RewardFn,
    samples: int = 1,
    temperature: float = 0.0,
    max_new_tokens: int = 8,
    seed: int = 0,
) -> torch.Tensor:
    """Rewards [len(rows), samples] of `samples` completions per row (row-major groups)."""
    prompts = [encode_prompt(tokenizer, r.prompt) for r in rows for _ in range(samples)]
    gen = torch.Generator().manual_seed(seed)
    was_training = model.training
    model.eval()
    outs = complete(
        model,
        prompts,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
        max_new_tokens,
        temperature,
        gen,
    )
    model.train(was_training)
    texts = tokenizer.batch_decode(outs, skip_special_tokens=True)
    items = [
        (r.prompt, t, r.answer) for r, t in zip([r for r in rows for _ in range(samples)], texts)
    ]
    return torch.tensor(score_rewards(reward, items, "task")).view(len(rows), samples)
