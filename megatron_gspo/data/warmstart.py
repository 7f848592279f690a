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

PRESETS name model shapes for other regimes. `drift` (6 MoE layers of 32 experts, top-4, 1.28M
parameters, on sortlong's 20-token answers) is meant to show MoE routing drift and token-level
ratio noise under RL. Measured (seed 0, HF generate, ~3 min to build on 2 busy CPU cores): held-out greedy
accuracy 0.33 (the mistake 0.65); at temperature 1, 64 prompts x 8 samples: mean reward 0.29,
64% of the groups mixed (seed 1: 0.38; 0.33, 70%). `drift_long` is the same shape on
sortlong20's 40-token answers, the answer-length lever (seed 0, 3m48s on one thread): greedy
accuracy 0.42 on 64 held-out prompts (the mistake 0.59); sampled, 16 prompts x 4: 0.22, half the
groups mixed.

calc_tool (a tool task, data/transcripts.py) keeps the two phases with whole episodes, the loss
on the model's turns only: clean = the tool called on the prompt's expression, then its result
copied as the answer; sloppy = that with probability keep_right, else the mistake answered
directly in one turn. The model (chars tokenizer) learns to copy and prefers not to call, so RL
only has to raise the probability of the call. Measured (seed 0, HF generate, 2m10s to build on
one thread, 2m40s on 2 busy CPU cores; 200 held-out prompts, x4 samples at temperature 1):
greedy reward 0.065 (the tool called on 6.5%, the rest the mistake); sampled: the tool called on
37%, its expression right 100% and the answer copying its result 99.3%, mean reward 0.37 (all
1662 held-out prompts: greedy 0.083, sampled 0.34). Seeds 1 and 2: greedy 0.005 and 0.005;
sampled: tool rate 0.29 and 0.29, both copies 100%, mean reward 0.29 and 0.29.

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

from megatron_gspo.checks import INT_MAX, in_range
from megatron_gspo.data.prompts import PromptRow, encode_prompt, load_prompts
from megatron_gspo.data.task_model import PRESETS
from megatron_gspo.data.tasks import sloppy_answer
from megatron_gspo.data.transcripts import TOOL_TASKS, segments_batch, tool_task_batch
from megatron_gspo.errors import UserError
from megatron_gspo.hf.tiny import TinySpec, make_tiny_model
from megatron_gspo.outputs import (
    check_new_output,
    make_readable,
    stop_if_terminated,
    terminate_raises,
)

INFO_FILE = "warmstart.json"
# Copying the list back is an easier habit to pick up than forgetting a carry: with the arith
# setting the sort model almost never sorts when sampled (mean sampled reward 0.21, pass@8 0.37).
# sortlong (tuned on the drift preset): the switch to the mistake first breaks the sorting for a
# few hundred steps, so its sloppy phase is long, and both phases cool down (a constant rate left
# the checkpoint anywhere between 0.15 and 0.5 greedy accuracy depending on the last batches).
# calc_tool: the direct answer is a new skill of the sloppy phase (the table of tens digits behind
# its first digit); until it is learnt the first token is spread over the digits and greedy
# decoding picks <tool_call>. Batches of 32 (twice the steps for the same compute) learnt it on
# every seed tried and kept the copying of the tool's result (batches of 64: 0.76-0.91 right).
_SORTLONG = {
    "clean_steps": 300,
    "clean_lr": 5e-3,
    "warmup_steps": 30,
    "sloppy_steps": 450,
    "sloppy_lr": 2e-3,
    "cooldown_steps": 150,
    "keep_right": 0.3,
}
TASK_DEFAULTS: dict[str, dict] = {
    "arith": {},
    "sort": {"keep_right": 0.4},
    "sortlong": _SORTLONG,
    # sortlong20 (twice the digits): sortlong's schedule, a longer clean phase for the longer sort
    "sortlong20": {**_SORTLONG, "clean_steps": 500},
    "calc_tool": {
        "moe_ffn": 32,
        "batch_size": 32,
        "clean_steps": 700,
        "clean_lr": 5e-3,
        "sloppy_steps": 700,
        "sloppy_lr": 7e-3,
        "cooldown_steps": 250,
        "keep_right": 0.3,
    },
}


@dataclass
class WarmStartSpec:
    """Model sizes and the two fine-tuning phases (steps of `batch_size` prompts); the defaults
    are arith's (TASK_DEFAULTS holds each task's changes). Each phase warms its learning rate up
    linearly over `warmup_steps`, then holds it, or lowers it linearly towards 0 over its last
    `cooldown_steps` when that is not 0."""

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
    cooldown_steps: int = 0

    def tiny_spec(self, seed: int, tokenizer: str = "words") -> TinySpec:
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
            tokenizer=tokenizer,
        )


def task_model_spec(
    task: str | None = None, preset: str | None = None, **knobs
) -> tuple[str, WarmStartSpec]:
    """The task and settings a task model is built with: WarmStartSpec's defaults, then the task's
    (TASK_DEFAULTS), then the preset's model shape, then `knobs`. The task is `task`, else the
    preset's, else arith. Bad values are a one-line UserError."""
    shape = dict(PRESETS.get(preset, {}))
    if preset is not None and not shape:
        raise UserError(f"unknown preset {preset!r}; choose one of: {', '.join(PRESETS)}")
    preset_task = shape.pop("task", "arith")
    task = preset_task if task is None else task
    if task not in TASK_DEFAULTS:
        raise UserError(f"unknown task {task!r}; choose one of: {', '.join(TASK_DEFAULTS)}")
    known = {f.name for f in fields(WarmStartSpec)}
    unknown = sorted(set(knobs) - known)
    if unknown:
        raise UserError(f"unknown warm-start setting(s) {unknown}; known: {sorted(known)}")
    spec = WarmStartSpec(**{**TASK_DEFAULTS[task], **shape, **knobs})
    _check(spec)
    return task, spec


def _check(spec: WarmStartSpec) -> None:
    # (each value is its flag's, or the preset's or task's where the flag was not given)
    if spec.layers < 2:
        raise UserError(f"--layers {spec.layers}: the task model needs >= 2 layers")
    if spec.experts < 2:
        raise UserError(f"--experts {spec.experts}: the task model needs >= 2 experts")
    if not 1 <= spec.topk <= spec.experts:
        raise UserError(
            f"--topk {spec.topk}: the experts per token must be in [1, {spec.experts}] "
            f"(--experts {spec.experts}); lower --topk or raise --experts"
        )
    if spec.hidden < 8 or spec.hidden % 8:
        raise UserError(
            f"--hidden {spec.hidden}: the task model needs a multiple of 8 (4 heads of an even "
            "size)"
        )
    if spec.moe_ffn < 1:
        raise UserError(f"--moe-ffn {spec.moe_ffn}: the task model needs >= 1")
    if not 0.0 <= spec.keep_right <= 1.0:
        raise UserError(f"keep_right is a probability, got {spec.keep_right}")
    if spec.batch_size < 1 or spec.warmup_steps < 1 or spec.cooldown_steps < 0:
        raise UserError("batch_size and warmup_steps must be >= 1 and cooldown_steps >= 0")


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
    masks = [[0.0] * p + [1.0] * (len(seq) - p) for seq, p in zip(seqs, n_prompt)]
    return segments_batch(tokenizer, list(zip(seqs, masks)))


def _task_batch(tokenizer, task: str, rows: list[PromptRow], sloppy: list[bool]):
    """The batch of `rows`, with the task's typical mistake where `sloppy` (tool tasks: answered
    directly, the right answers through the tool; data/transcripts.py)."""
    if task in TOOL_TASKS:
        return tool_task_batch(tokenizer, task, rows, sloppy)
    answers = [
        sloppy_answer(task, r.prompt, r.answer) if s else r.answer for r, s in zip(rows, sloppy)
    ]
    return _batch(tokenizer, rows, answers)


def _answer_nll(model, ids: torch.Tensor, attn: torch.Tensor, loss_mask: torch.Tensor):
    """Mean negative log-likelihood of the answer tokens: -sum(m * log p(x_t | x_<t)) / sum(m)."""
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    mask = loss_mask[:, 1:]
    return -(logp * mask).sum() / mask.sum()


def lr_scale(spec: WarmStartSpec, step: int, steps: int) -> float:
    """Linear warmup over warmup_steps; then 1, or a linear fall over the last cooldown_steps."""
    scale = min(1.0, (step + 1) / spec.warmup_steps)
    if spec.cooldown_steps:
        scale *= min(1.0, (steps - step) / spec.cooldown_steps)
    return scale


def _train(model, tokenizer, task, rows, spec, rng, phase: str) -> float:
    steps = spec.clean_steps if phase == "clean" else spec.sloppy_steps
    lr = spec.clean_lr if phase == "clean" else spec.sloppy_lr
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    loss = torch.tensor(float("nan"))
    for step in range(steps):
        batch = rng.sample(rows, spec.batch_size)
        sloppy = [phase == "sloppy" and rng.random() >= spec.keep_right for _ in batch]
        for group in opt.param_groups:
            group["lr"] = lr * lr_scale(spec, step, steps)
        loss = _answer_nll(model, *_task_batch(tokenizer, task, batch, sloppy))
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


def make_task_model(
    out: str | os.PathLike,
    task: str | None = None,
    seed: int = 0,
    preset: str | None = None,
    **knobs,
) -> Path:
    """Write a partly competent tiny Qwen3-MoE for `task` (HF checkpoint + tokenizer) to `out`.

    `preset` names a model shape in PRESETS (with its task, used when `task` is None; arith
    without either); `knobs` override WarmStartSpec fields. The checkpoint appears at `out`
    complete or not at all (built in a temporary directory beside it, then renamed; the directory
    is removed on an error, SIGINT or SIGTERM). `out` must not exist and must be creatable; both
    are checked before any work, as convert checks its --out.
    """
    in_range(seed, "--seed", 0, INT_MAX)  # (train's seed: the same range)
    task, spec = task_model_spec(task, preset, **knobs)
    out = check_new_output(out, "--out")
    out.parent.mkdir(parents=True, exist_ok=True)
    threads = torch.get_num_threads()
    with terminate_raises():  # (SIGTERM or SIGINT: the finally removes tmp)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        try:
            torch.set_num_threads(1)
            tokenizer = "chars" if task in TOOL_TASKS else "words"
            work = make_tiny_model(spec.tiny_spec(seed, tokenizer), tmp / "model")
            info = {"task": task, "seed": seed, "preset": preset, **asdict(spec)}
            info.update(_fine_tune(work, task, seed, spec))
            (work / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
            stop_if_terminated()
            make_readable(work)  # (save_pretrained wrote model.safetensors 0600 again)
            os.replace(work, out)
        finally:
            torch.set_num_threads(threads)
            shutil.rmtree(tmp, ignore_errors=True)
    return out
