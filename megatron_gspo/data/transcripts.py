"""Multi-turn tool episodes as text segments, built with the tokenizer's chat template.

An episode of the calc_tool task, as the episode runner produces it (hf/tiny.py's chars
tokenizer and CHAT_TEMPLATE), segment by segment; `trained` marks what the model writes:

  prompt       <|im_start|>system\\ntools: calc<|im_end|>\\n<|im_start|>user\\nwhat is 37*48 ?
               <|im_end|>\\n<|im_start|>assistant\\n                                      (no)
  turn 1       <tool_call>\\n{"name": "calc", "arguments": {"expr": "37*48"}}\\n</tool_call>
               <|im_end|>                                                                 (yes)
  environment  \\n<|im_start|>user\\n<tool_response>\\n1776\\n</tool_response><|im_end|>\\n
               <|im_start|>assistant\\n                                                    (no)
  turn 2       1776<|im_end|>                                                            (yes)

or, without the tool, the prompt and one turn, the answer: `1776<|im_end|>`. The reward reads
the last turn only. Each segment is the difference between two renderings of the conversation
(before and after the assistant message), so the pieces concatenate to the template's rendering
of the whole conversation, less its trailing "\\n".
"""

from __future__ import annotations

import functools

import torch

from megatron_gspo.data.prompts import PromptRow
from megatron_gspo.data.tasks import sloppy_answer
from megatron_gspo.rollout.tools import REGISTRY, calc

# the calc tool as the episode runner offers and runs it (env.fn: tools, env.tools: [calc])
CALC_SCHEMA = REGISTRY["calc"].schema
TOOL_TASKS = {"calc_tool": [CALC_SCHEMA]}  # the tools each tool task's prompt offers

Segment = tuple[str, bool]  # (text, written by the model)


def prompt_expr(prompt: str) -> str:
    """The expression a calc_tool prompt asks for: "what is 37*48 ?" -> "37*48"."""
    return prompt.removeprefix("what is ").removesuffix(" ?")


def calc_messages(prompt: str, answer: str, uses_tool: bool) -> list[dict]:
    """The conversation: user prompt, then (with the tool) a calc call on the prompt's expression,
    the calc tool's result and the final answer, or (without) the answer alone."""
    user = {"role": "user", "content": prompt}
    if not uses_tool:
        return [user, {"role": "assistant", "content": answer}]
    expr = prompt_expr(prompt)
    call = {"type": "function", "function": {"name": "calc", "arguments": {"expr": expr}}}
    return [
        user,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": calc(expr)},
        {"role": "assistant", "content": answer},
    ]


def chat_segments(tokenizer, messages: list[dict], tools: list[dict]) -> list[Segment]:
    """`messages` rendered by the chat template as alternating (context, False) and
    (assistant turn up to and including EOS, True) segments."""

    def render(msgs: list[dict], generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(
            msgs, tools=tools, add_generation_prompt=generation_prompt, tokenize=False
        )

    eos = tokenizer.eos_token
    segments: list[Segment] = []
    done = ""
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before, after = render(messages[:i], True), render(messages[: i + 1], False)
        if not (
            before.startswith(done) and after.startswith(before) and eos in after[len(before) :]
        ):
            raise ValueError("the chat template does not render the conversation turn by turn")
        turn = after[len(before) : after.rindex(eos) + len(eos)]
        segments += [(before[len(done) :], False), (turn, True)]
        done = before + turn
    return segments


def calc_segments(tokenizer, prompt: str, answer: str, uses_tool: bool) -> list[Segment]:
    """The segments of one calc_tool episode (see the module docstring)."""
    return chat_segments(tokenizer, calc_messages(prompt, answer, uses_tool), [CALC_SCHEMA])


def encode_segments(tokenizer, segments: list[Segment]) -> tuple[list[int], list[float]]:
    """Token ids of the segments, one after the other, and 1.0 on the trained ones' tokens."""
    ids: list[int] = []
    mask: list[float] = []
    for text, trained in segments:
        piece = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += piece
        mask += [float(trained)] * len(piece)
    return ids, mask


def segments_batch(
    tokenizer, episodes: list[tuple[list[int], list[float]]]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded token ids, attention mask, and the loss mask of encoded episodes
    (encode_segments): 1 on the model's tokens, 0 on the prompt, the environment and padding."""
    seqs, masks = [ids for ids, _ in episodes], [mask for _, mask in episodes]
    length = max(map(len, seqs))
    ids_t = torch.full((len(seqs), length), tokenizer.pad_token_id, dtype=torch.long)
    attn = torch.zeros_like(ids_t)
    loss_mask = torch.zeros(ids_t.shape, dtype=torch.float32)
    for i, (seq, mask) in enumerate(zip(seqs, masks)):
        ids_t[i, : len(seq)] = torch.tensor(seq)
        attn[i, : len(seq)] = 1
        loss_mask[i, : len(seq)] = torch.tensor(mask)
    return ids_t, attn, loss_mask


def tool_task_batch(
    tokenizer, task: str, rows: list[PromptRow], sloppy: list[bool]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The warm start's batch of a tool task: the right answer through the tool, or where
    `sloppy`, the task's typical mistake answered directly in one turn."""
    if task != "calc_tool":
        raise KeyError(task)
    episodes = [
        _calc_episode(tokenizer, r.prompt, sloppy_answer(task, r.prompt, r.answer), False)
        if s
        else _calc_episode(tokenizer, r.prompt, r.answer, True)
        for r, s in zip(rows, sloppy)
    ]
    return segments_batch(tokenizer, episodes)


# rendering a batch's episodes with the template costs a third of a training step: once each
@functools.lru_cache(maxsize=1 << 15)
def _calc_episode(tokenizer, prompt: str, answer: str, uses_tool: bool):
    return encode_segments(tokenizer, calc_segments(tokenizer, prompt, answer, uses_tool))
