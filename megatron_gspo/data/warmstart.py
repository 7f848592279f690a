"""The starting checkpoint of the tiny RL run: a tiny Qwen3-MoE that is partly competent on a task.

Deliberate design (why not simply under-train): a checkpoint stopped early on the clean task sits
on the steep part of its learning curve, where greedy accuracy depends on the seed and even on the
thread count, and where RL has to teach new skills from sparse rewards: 40 steps of 8 x 8 samples
raised held-out greedy accuracy by 0.1-0.2, unreliably. So the model is taught in two phases:

1. clean: supervised fine-tuning on the task's train split until it nearly solves it;
2. sloppy: a short fine-tuning on a teacher who, on the prompts where the task's typical mistake
   (tasks.sloppy_answer) differs from the answer, gives that mistake with probability
   1 - keep_right and the right answer otherwise.

The result knows the task but prefers the mistake: greedy answers are right mainly where the
mistake coincides with the answer (~22% of prompts), while sampling still finds the right answer
on many others, so reward-driven RL has a clear, learnable signal on held-out prompts. Measured
(arith, seed 0, HF model, 8 prompts x 8 samples a step, sequence-ratio loss with 4 minibatches,
Adam lr 2e-4): held-out greedy accuracy 0.22 -> 0.43 / 0.73 / 0.88 after 10 / 15 / 20 steps.

Deterministic for a seed: batches come from random.Random(seed), weights from torch.manual_seed,
and training runs on one thread (the reduction order of a matmul changes with the thread count).
HF transformers only.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from megatron_gspo.data.prompts import PromptRow, encode_prompt, load_prompts
from megatron_gspo.data.tasks import sloppy_answer
from megatron_gspo.errors import UserError
from megatron_gspo.model.tiny import TinySpec, make_tiny_model

INFO_FILE = "warmstart.json"
# Copying the list back is an easier habit to pick up than forgetting a carry: with the arith
# setting the sort model almost never sorts when sampled (mean sampled reward 0.21, pass@8 0.37).
TASK_DEFAULTS: dict[str, dict] = {"arith": {}, "sort": {"keep_right": 0.4}}


@dataclass
class WarmStartSpec:
    """Model sizes and the two fine-tuning phases (steps of `batch_size` prompts); the defaults
    are arith's (TASK_DEFAULTS holds each task's changes)."""

    hidden: int = 64
    layers: int = 2
    moe_ffn: int = 64
    experts: int = 8
    topk: int = 2
    batch_size: int = 64
    clean_steps: int = 300
    clean_lr: float = 1e-2
    warmup_steps: int = 20
    sloppy_steps: int = 100
    sloppy_lr: float = 3e-3
    keep_right: float = 0.25

    def tiny_spec(self, seed: int) -> TinySpec:
        return TinySpec(
            hidden=self.hidden,
            layers=self.layers,
            heads=4,
            kv_heads=2,
            head_dim=self.hidden // 4,
            ffn=2 * self.hidden,
            moe_ffn=self.moe_ffn,
            experts=self.experts,
            topk=self.topk,
            seed=seed,
        )


def _spec(task: str, knobs: dict) -> WarmStartSpec:
    if task not in TASK_DEFAULTS:
        raise UserError(f"unknown task {task!r}; choose one of: {', '.join(TASK_DEFAULTS)}")
    known = {f.name for f in fields(WarmStartSpec)}
    unknown = sorted(set(knobs) - known)
    if unknown:
        raise UserError(f"unknown warm-start setting(s) {unknown}; known: {sorted(known)}")
    spec = WarmStartSpec(**{**TASK_DEFAULTS[task], **knobs})
    if spec.layers < 2 or spec.experts < 2 or not 1 <= spec.topk <= spec.experts:
        raise UserError("the task model needs >= 2 layers and 1 <= topk <= experts >= 2")
    if not 0.0 <= spec.keep_right <= 1.0:
        raise UserError(f"keep_right is a probability, got {spec.keep_right}")
    return spec


def _batch(
    tokenizer, rows: list[PromptRow], answers: list[str]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded prompt+answer+EOS ids, attention mask, and a mask of the answer tokens."""
    seqs, n_prompt = [], []
    for row, answer in zip(rows, answers):
        prompt = encode_prompt(tokenizer, row.prompt)
        target = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        seqs.append(prompt + target)
        n_prompt.append(len(prompt))
    length = max(map(len, seqs))
    ids = torch.full((len(seqs), length), tokenizer.pad_token_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    loss_mask = torch.zeros(ids.shape, dtype=torch.float32)
    for i, (seq, p) in enumerate(zip(seqs, n_prompt)):
        ids[i, : len(seq)] = torch.tensor(seq)
        attn[i, : len(seq)] = 1
        loss_mask[i, p : len(seq)] = 1.0
    return ids, attn, loss_mask


def _answer_nll(model, ids: torch.Tensor, attn: torch.Tensor, loss_mask: torch.Tensor):
    """Mean negative log-likelihood of the answer tokens: -sum(m * log p(x_t | x_<t)) / sum(m)."""
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    mask = loss_mask[:, 1:]
    return -(logp * mask).sum() / mask.sum()


def _train(model, tokenizer, task, rows, spec, rng, phase: str) -> float:
    steps = spec.clean_steps if phase == "clean" else spec.sloppy_steps
    lr = spec.clean_lr if phase == "clean" else spec.sloppy_lr
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    loss = torch.tensor(float("nan"))
    for step in range(steps):
        batch = rng.sample(rows, spec.batch_size)
        answers = [
            sloppy_answer(task, r.prompt, r.answer)
            if phase == "sloppy" and rng.random() >= spec.keep_right
            else r.answer
            for r in batch
        ]
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / spec.warmup_steps)
        loss = _answer_nll(model, *_batch(tokenizer, batch, answers))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return loss.item()


def _fine_tune(path: Path, task: str, seed: int, spec: WarmStartSpec) -> dict:
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    rows = load_prompts(f"builtin:{task}", "train", seed).rows
    if len(rows) < spec.batch_size:
        raise UserError(f"batch_size {spec.batch_size} exceeds the {len(rows)} train prompts")
    rng = random.Random(seed)
    torch.manual_seed(seed)
    model.train()
    losses = {p: _train(model, tokenizer, task, rows, spec, rng, p) for p in ("clean", "sloppy")}
    model.eval()
    model.save_pretrained(path)
    return {f"{phase}_final_loss": round(loss, 4) for phase, loss in losses.items()}


def make_task_model(out: str | os.PathLike, task: str = "arith", seed: int = 0, **knobs) -> Path:
    """Write a partly competent tiny Qwen3-MoE for `task` (HF checkpoint + tokenizer) to `out`.

    `knobs` override WarmStartSpec fields. The checkpoint appears at `out` complete or not at
    all (built in a temporary directory beside it, then renamed). `out` must not exist.
    """
    out = Path(out)
    spec = _spec(task, knobs)
    if out.exists():
        raise UserError(f"{out} exists; remove it or pass another --out")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        work = make_tiny_model(spec.tiny_spec(seed), tmp / "model")
        info = {"task": task, "seed": seed, **asdict(spec), **_fine_tune(work, task, seed, spec)}
        (work / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
        os.replace(work, out)
    finally:
        torch.set_num_threads(threads)
        shutil.rmtree(tmp, ignore_errors=True)
    return out
