"""A multi-turn episode against the built-in server and real SGLang 0.5.23: at temperature 0 both
give the token ids and loss mask of the same episode computed with HF transformers alone (greedy
argmax turn by turn, the environment's answers written out), and log-probs and R3 routing for
the model's tokens as a teacher-forced HF forward of the whole episode gives them.
"""

import asyncio
import time

import pytest
import torch
from transformers import AutoTokenizer

from megatron_gspo.data.prompts import PromptRow
from megatron_gspo.hf.tiny import TinySpec, make_tiny_model
from megatron_gspo.rollout.client import RolloutClient
from megatron_gspo.rollout.env import EnvCalls
from megatron_gspo.rollout.episodes import ChatRender, EpisodeRunner, Limits
from megatron_gspo.rollout.launcher import ServerGroup
from tests.contract.sglang_venv import server_config

pytestmark = pytest.mark.contract

# every layer MoE (SGLang 0.5.23 ignores mlp_only_layers); the chat tokenizer: one token a char
SPEC = TinySpec(tokenizer="chars", layers=2, init_std=0.2, seed=11)
ROW = PromptRow("what is 12*34 ?", "408")
LIMITS = Limits(max_turns=4, max_turn_tokens=6, max_tokens=120)
ANSWERS = [  # the environment's answer to each turn, and as the chat template writes it
    ([{"role": "tool", "content": "408"}],
     "\n<|im_start|>user\n<tool_response>\n408\n</tool_response><|im_end|>\n<|im_start|>assistant\n"),
    ("go on:", "go on:"),
    ([{"role": "user", "content": "and?"}],
     "\n<|im_start|>user\nand?<|im_end|>\n<|im_start|>assistant\n"),
]  # fmt: skip
ATOL = {"builtin": 1e-4, "sglang": 2e-5}


ENV = """
from megatron_gspo.rollout.env import Step

ANSWERS = {answers!r}


class Env:
    def __init__(self, row):
        self.row = row

    def prompt(self):
        return [{{"role": "user", "content": self.row.prompt}}]

    def step(self, turn):
        if turn.index == len(ANSWERS):
            return Step(done=True)
        return Step(ANSWERS[turn.index])
"""


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(SPEC, tmp_path_factory.mktemp("episodes") / "chat")


@pytest.fixture(scope="module", params=["builtin", "sglang"])
def server(request, model, tmp_path_factory):
    kind = request.param
    logs = tmp_path_factory.mktemp(f"logs-{kind}")
    t0 = time.monotonic()
    with ServerGroup([server_config(kind, model)], logs, health_timeout_s=900,
                     monitor=False) as group:  # fmt: skip
        print(f"{kind} server healthy after {time.monotonic() - t0:.1f} s")
        yield kind, group.urls[0]


def hf_episode(model, tok):
    """The episode by HF alone: prompt, greedy turns (stopping after an end-of-turn id or the
    turn limit), the environment's answers as the template text above; (tokens, mask)."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    stop = {tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")}
    text = "<|im_start|>user\nwhat is 12*34 ?<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(text, add_special_tokens=False)
    tokens, mask = [], []
    for t in range(len(ANSWERS) + 1):
        for _ in range(LIMITS.max_turn_tokens):
            with torch.no_grad():
                nxt = int(hf(torch.tensor([ids + tokens])).logits[0, -1].argmax())
            tokens.append(nxt)
            mask.append(1)
            if nxt in stop:
                break
        if t < len(ANSWERS):
            env = tok.encode(ANSWERS[t][1], add_special_tokens=False)
            tokens += env
            mask += [0] * len(env)
    return ids, tokens, mask


def test_a_multi_turn_episode_is_the_same_on_both_servers_and_hf(server, model, tmp_path):
    kind, url = server
    tok = AutoTokenizer.from_pretrained(model)
    env = tmp_path / "env.py"  # (the environment runs in a worker process, which imports it)
    env.write_text(ENV.format(answers=[a for a, _ in ANSWERS]))
    calls = EnvCalls(f"{env}:Env", timeout_s=10.0, vocab_size=len(tok), workers=1)
    runner = EpisodeRunner(calls, ChatRender(tok), LIMITS)

    async def go():
        async with RolloutClient([url], topk=2) as client:
            return await runner.run(client, ROW, [1], {"temperature": 0.0}, True, (0, 0), 1)

    try:
        s = asyncio.run(go())
    finally:
        calls.close()
    prompt, tokens, mask = hf_episode(model, tok)
    assert s.env_error is None and s.turns == len(ANSWERS) + 1
    assert (s.prompt_ids, s.tokens, s.loss_mask) == (prompt, tokens, mask)
    from tests.contract.test_server_contract import hf_reference

    logp, topk = hf_reference(model, prompt + tokens)
    want = logp[len(prompt) - 1 : -1].gather(1, torch.tensor(tokens)[:, None])[:, 0]
    on = torch.tensor(mask, dtype=torch.bool)
    got = torch.tensor([v if v is not None else 0.0 for v in s.logprobs])
    torch.testing.assert_close(got[on], want[on], atol=ATOL[kind], rtol=0)
    assert s.routed_experts.shape == (len(prompt) + len(tokens) - 1, SPEC.layers, 2)
    routed = torch.from_numpy(s.routed_experts).sort(-1).values.long()
    assert torch.equal(routed, topk[:-1])
