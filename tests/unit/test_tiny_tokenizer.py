"""The tiny checkpoints' tokenizers: `words` exactly as it always was, and `chars` (one token a
character, Qwen3's tool tokens whole, a chat template, EOS <|im_end|>) giving any text back
exactly."""

import hashlib
import json

import pytest

from megatron_gspo.hf.tiny import (
    CHARS,
    CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    TOOL_TOKENS,
    TinySpec,
    build_tokenizer,
    make_tiny_model,
    vocabulary,
)

pytestmark = pytest.mark.unit

TEXT = (
    "<|im_start|>system\ntools: calc<|im_end|>\n<|im_start|>user\n  what is 37*48 ?\n\n"
    '<|im_end|>\n<|im_start|>assistant\n<tool_call>\n{"name": "calc", "arguments": '
    '{"expr": "37*48"}}\n</tool_call><|im_end|>\n<tool_response>\n1776\n</tool_response> '
    "<tool_call <tool_callx>" + "".join(CHARS) + "  "
)


@pytest.fixture(scope="module")
def chars(tmp_path_factory):
    from transformers import AutoTokenizer

    spec = TinySpec(tokenizer="chars", hidden=16, layers=1, head_dim=4, moe_ffn=4, experts=2)
    path = make_tiny_model(spec, tmp_path_factory.mktemp("chars") / "m")
    return path, AutoTokenizer.from_pretrained(path)


def test_words_tokenizer_is_unchanged():
    # the sha256 of tokenizer.json before the chars tokenizer was added: old checkpoints and the
    # task models built from them stay byte-identical
    digest = hashlib.sha256(build_tokenizer(128).to_str().encode()).hexdigest()
    assert digest == "b636fd67fad51efa5876086661b4aaff5479c23ab03b472d143a3e233f554b11"
    assert vocabulary(128) == vocabulary(128, "words")
    assert TinySpec().tokenizer == "words"


def test_chars_vocabulary():
    words = vocabulary(128, "chars")
    assert words[: len(SPECIAL_TOKENS)] == SPECIAL_TOKENS
    assert words[len(SPECIAL_TOKENS) : len(SPECIAL_TOKENS) + 4] == TOOL_TOKENS
    assert {"\n", " ", "{", "*", "~"} <= set(words) and "\t" not in words
    assert len(words) == 128 and len(set(words)) == 128 and words[-1].startswith("<extra_")
    with pytest.raises(ValueError, match="at least 105"):
        vocabulary(100, "chars")
    with pytest.raises(ValueError, match="unknown tokenizer"):
        vocabulary(128, "bytes")


@pytest.mark.parametrize("raw", [False, True], ids=["hf", "tokenizers"])
def test_chars_round_trip_any_text(chars, raw):
    tok = build_tokenizer(128, "chars") if raw else chars[1]
    ids = tok.encode(TEXT).ids if raw else tok.encode(TEXT, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=False) == TEXT
    unk = SPECIAL_TOKENS.index("<unk>")
    assert unk not in ids
    # one token a character, except the special and tool tokens, each one token
    whole = SPECIAL_TOKENS + TOOL_TOKENS
    assert len(ids) == len(TEXT) - sum(TEXT.count(t) * (len(t) - 1) for t in whole)


def test_chars_checkpoint_ends_turns_and_keeps_tool_tokens(chars):
    path, tok = chars
    im_end, endoftext = (SPECIAL_TOKENS.index(t) for t in ("<|im_end|>", "<|endoftext|>"))
    assert (tok.eos_token, tok.eos_token_id, tok.pad_token) == ("<|im_end|>", im_end, "<|pad|>")
    gen = json.loads((path / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [im_end, endoftext]
    assert tok.chat_template == CHAT_TEMPLATE and len(tok) == 128
    ids = tok.encode("1776<|im_end|>", add_special_tokens=False)
    assert ids[-1] == im_end and tok.decode(ids, skip_special_tokens=True) == "1776"
    call = '<tool_call>\n{"a": 1}\n</tool_call><|im_end|>'
    ids = tok.encode(call, add_special_tokens=False)
    # the tool tokens are not special: they survive skip_special_tokens, as in Qwen3
    assert tok.decode(ids, skip_special_tokens=True) == call.removesuffix("<|im_end|>")
    assert tok("hi")["input_ids"] == tok.encode("hi", add_special_tokens=False)  # no BOS


def test_chat_template_renders_qwen3_format(chars):
    tok = chars[1]
    tool = {"type": "function", "function": {"name": "calc"}}
    other = {"name": "search"}  # a bare function also works
    msgs = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "let me", "tool_calls": [
            {"function": {"name": "calc", "arguments": '{"expr": "1+1"}'}},
            {"name": "search", "arguments": {"q": "x"}},
        ]},
        {"role": "tool", "content": "2"},
        {"role": "tool", "content": "found"},
        {"role": "assistant", "content": "2"},
    ]  # fmt: skip
    text = tok.apply_chat_template(msgs, tools=[tool, other], tokenize=False)
    assert text == (
        "<|im_start|>system\ntools: calc, search<|im_end|>\n<|im_start|>user\nq<|im_end|>\n"
        '<|im_start|>assistant\nlet me\n<tool_call>\n{"name": "calc", "arguments": '
        '{"expr": "1+1"}}\n</tool_call>\n<tool_call>\n{"name": "search", "arguments": '
        '{"q": "x"}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n2\n'
        "</tool_response>\n<tool_response>\nfound\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n2<|im_end|>\n"
    )
    plain = tok.apply_chat_template(msgs[:1], add_generation_prompt=True, tokenize=False)
    assert plain == "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n"
