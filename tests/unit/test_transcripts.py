"""calc_tool episodes as the warm start trains on them: the chat template's rendering cut into
the model's turns and the rest, tokenizing the same in pieces as whole, with the environment's
tokens exactly what the episode runner appends."""

import pytest
import torch

from megatron_gspo.data.prompts import PromptRow
from megatron_gspo.data.transcripts import (
    CALC_SCHEMA,
    calc_messages,
    calc_segments,
    encode_segments,
    prompt_expr,
    tool_task_batch,
)
from megatron_gspo.hf.tiny import TinySpec, make_tiny_model
from megatron_gspo.rollout.episodes import ChatRender
from megatron_gspo.rollout.tool_calls import parse_tool_calls
from megatron_gspo.rollout.tools import REGISTRY, calc, call_tool

pytestmark = pytest.mark.unit

PROMPT = (
    "<|im_start|>system\ntools: calc<|im_end|>\n<|im_start|>user\nwhat is 37*48 ?<|im_end|>\n"
    "<|im_start|>assistant\n"
)
TURN1 = '<tool_call>\n{"name": "calc", "arguments": {"expr": "37*48"}}\n</tool_call><|im_end|>'
ENV = (
    "\n<|im_start|>user\n<tool_response>\n1776\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    spec = TinySpec(tokenizer="chars", hidden=16, layers=1, head_dim=4, moe_ffn=4, experts=2)
    return AutoTokenizer.from_pretrained(make_tiny_model(spec, tmp_path_factory.mktemp("t") / "m"))


def test_expression_and_result():
    assert prompt_expr("what is 37*48 ?") == "37*48"
    assert calc("37*48") == "1776" and calc("10*10") == "100"  # the tool result it is trained on


def test_tool_episode_segments(tok):
    segments = calc_segments(tok, "what is 37*48 ?", "1776", uses_tool=True)
    assert segments == [
        (PROMPT, False),
        (TURN1, True),
        (ENV, False),
        ("1776<|im_end|>", True),
    ]
    whole = tok.apply_chat_template(
        calc_messages("what is 37*48 ?", "1776", True), tools=[CALC_SCHEMA], tokenize=False
    )
    text = "".join(t for t, _ in segments)
    assert text + "\n" == whole
    pieces = [i for t, _ in segments for i in tok.encode(t, add_special_tokens=False)]
    assert tok.encode(text, add_special_tokens=False) == pieces


def test_direct_episode_segments(tok):
    segments = calc_segments(tok, "what is 37*48 ?", "1256", uses_tool=False)
    assert segments == [(PROMPT, False), ("1256<|im_end|>", True)]


def test_segments_are_what_the_episode_runner_produces(tok):
    render = ChatRender(tok)
    user = [{"role": "user", "content": "what is 37*48 ?"}]
    assert render.prompt(user, tools=[CALC_SCHEMA]) == tok.encode(PROMPT, add_special_tokens=False)
    env = render.continuation([{"role": "tool", "content": "1776"}])
    assert env == tok.encode(ENV, add_special_tokens=False)
    calls, errors = parse_tool_calls(TURN1)
    assert errors == [] and [(c.name, c.arguments) for c in calls] == [("calc", {"expr": "37*48"})]
    assert call_tool(REGISTRY, calls[0]) == "1776"


def test_batch_masks_the_prompt_and_the_environment(tok):
    rows = [PromptRow("what is 37*48 ?", "1776"), PromptRow("what is 20*30 ?", "600")]
    ids, attn, mask = tool_task_batch(tok, "calc_tool", rows, [False, True])
    tool_ids, tool_mask = encode_segments(tok, calc_segments(tok, rows[0].prompt, "1776", True))
    assert ids.shape == (2, len(tool_ids)) and attn[0].all()
    assert ids[0].tolist() == tool_ids and mask[0].tolist() == tool_mask
    trained = tok.decode(ids[0][mask[0] > 0], skip_special_tokens=False)
    assert trained == TURN1 + "1776<|im_end|>"
    # the sloppy row answers directly with the task's mistake (here right: 2*3*100 + 0*0)
    n = int(attn[1].sum())
    assert tok.decode(ids[1][mask[1] > 0]) == "600<|im_end|>"
    assert (ids[1, n:] == tok.pad_token_id).all() and not mask[1, n:].any()
    assert mask.dtype == torch.float32
    with pytest.raises(KeyError):
        tool_task_batch(tok, "arith", rows, [False, False])
