"""The rollout keys of the run config: where rollouts come from (`rollout:`) and, for multi-turn
rollouts, the environment that answers the model's turns (`env:`, rollout/episodes.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit

from megatron_gspo.checks import (
    MIN_CALL_SECONDS,
    choice,
    in_range,
    plugin_spec,
    positive,
    seconds,
    show,
)
from megatron_gspo.errors import UserError
from megatron_gspo.rollout.modes import Backend, Placement

SERVER_DTYPES = ("float32", "bfloat16", "float16")
MAX_STALENESS = 8  # batches generated ahead (each holds a batch of samples in memory)


# What SGLang 0.5.23 serves in a model context of C tokens, without --allow-auto-truncate and with
# a KV pool of at least C tokens (the built-in server does the same: server/api.py). Past its
# TokenizerManager's 400s (a prompt of C tokens or more; prompt + an explicit max_new_tokens > C),
# its scheduler is stricter: max_req_len = C - 1 and max_req_input_len = max_req_len - 5
# (srt/managers/tp_worker.py:568-572); a prompt of max_req_input_len tokens or more is a 400
# (srt/managers/utils.py:272), and max_new_tokens is cut, without a word, to
# max_req_len - prompt - 1 (srt/managers/scheduler.py:2710-2716): the generation ends early,
# finish_reason length.
def longest_prompt(context: int) -> int:
    """The longest prompt SGLang serves in a context of `context` tokens: context - 7."""
    max_req_input_len = (context - 1) - 5
    return max_req_input_len - 1


def longest_sequence(context: int) -> int:
    """The most tokens a prompt and its generation hold on SGLang in a context of `context`
    tokens (context - 2): a max_new_tokens that asks for more is cut to what is left."""
    max_req_len = context - 1
    return max_req_len - 1


@dataclass
class RolloutSection:
    backend: Backend = Backend.BUILTIN
    servers: int = 1  # servers the trainer starts and supervises (when urls is empty)
    # servers started by someone else; one serving a model of another vocabulary than the one
    # trained is refused at start (rollout/served_model.py)
    urls: list[str] = field(default_factory=list)
    # the node (the launcher's node index) each of `urls` runs on; with sync.method=tensor, servers
    # on several nodes get their buckets through a trainer rank on their own node (a relay).
    # launch/torchrun.sh sets it, and tells each trainer rank its node (MEGATRON_GSPO_NODE_RANK)
    url_nodes: list[int] = field(default_factory=list)
    # sglang-router in front of `urls`: generation goes through it (it balances the requests);
    # weight syncs, health checks and memory release still address every server in `urls`
    router_url: str | None = None
    placement: Placement = Placement.COLOCATED
    # colocated on GPUs: servers free their memory while the trainer trains (SGLang needs
    # --enable-memory-saver) and take it back before the weight sync
    release_memory: bool = False
    server_tp: int = 1
    sglang_python: str | None = None  # python of SGLang's own environment
    extra_server_args: list[str] = field(default_factory=list)
    group_size: int = 8
    prompts_per_step: int = 8
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    health_timeout_s: float = 300.0
    # rollout.urls (and router_url) that refuse every connection this long end the run at once:
    # nothing listens there. Raise it when the servers start along with the trainer
    connect_grace_s: float = 15.0
    # the servers' numerics (null: the checkpoint's dtype). bfloat16 against an fp32 trainer
    # opens the train-inference gap real engines have: log-probs and MoE routing then differ
    # between rollout and trainer (what R3 and algo.mismatch address)
    dtype: str | None = None  # float32 | bfloat16 | float16
    # fp8: the servers round their linear weights to float8 e4m3 (SGLang's --quantization fp8;
    # the built-in server's is weight-only, computed in rollout.dtype: server/quantize.py), a
    # larger train-inference gap, as FP8 rollouts against a BF16 trainer have
    quantization: str | None = None
    # batch-invariant server numerics (--enable-deterministic-inference, the built-in server's
    # and SGLang's): a sample's tokens and log-probs do not depend on what the server batched
    # it with, so a rerun with the same seeds gives the same run at any machine load. The
    # built-in server's forward then runs in parts: the decode steps at each position together,
    # each prefill alone (generation ~1.3-2x slower on the drift model), its products over at
    # least 4 rows (a CPU's BLAS takes another kernel for 1-3), and a bf16 or fp16 server's
    # without oneDNN (one kernel whatever their size; slower)
    deterministic: bool = False
    # one /generate request per prompt group (a batch, each sample with its own rid and seed)
    # instead of one per sample: less per-request overhead (not through router_url: the router
    # takes one sampling_params per request)
    group_requests: bool = True
    # N: the servers generate the batches of steps k+1..k+N while the trainer trains on step
    # k's, which is then N weight versions old (algo.mismatch=tis corrects for it); 0:
    # synchronous. train/ahead.py
    max_staleness: int = 0
    # with max_staleness: a weight sync does not wait for the generation in flight; its
    # requests are aborted, the weights synced, and each sample goes on from its tokens so far
    # on the new weights (rollout/partial.py; a sample's tokens then come from several versions)
    partial: bool = False

    def check(self) -> None:
        if self.dtype is not None:
            choice(self.dtype, "rollout.dtype", SERVER_DTYPES)
        if self.quantization is not None:
            choice(self.quantization, "rollout.quantization", ("fp8",))
        if not self.urls:
            positive(self.servers, "rollout.servers")
        if self.url_nodes and len(self.url_nodes) != len(self.urls):
            raise UserError(
                f"rollout.url_nodes has {len(self.url_nodes)} entries for {len(self.urls)} "
                "rollout.urls; give the node index of each URL's server, in the same order"
            )
        for i, node in enumerate(self.url_nodes):
            in_range(node, f"rollout.url_nodes[{i}]", 0)
        for i, url in enumerate(self.urls):
            check_url(url, f"rollout.urls[{i}]")
        if self.router_url and not self.urls:
            raise UserError(
                "rollout.router_url needs rollout.urls: the servers behind the router (weight "
                "syncs go to each of them)"
            )
        if self.router_url:
            check_url(self.router_url, "rollout.router_url")
        for name in ("server_tp", "group_size", "prompts_per_step", "max_new_tokens"):
            positive(getattr(self, name), f"rollout.{name}")
        if self.group_size < 2:
            raise UserError("rollout.group_size must be >= 2 (group advantages need a spread)")
        in_range(self.temperature, "rollout.temperature", 0)
        in_range(self.top_p, "rollout.top_p", 0, 1, lo_open=True)
        for name in ("health_timeout_s", "connect_grace_s"):
            seconds(getattr(self, name), f"rollout.{name}")
        in_range(self.max_staleness, "rollout.max_staleness", 0, MAX_STALENESS)
        if self.partial and not self.max_staleness:
            raise UserError(
                "rollout.partial continues generations across a weight update, which only "
                "overlap one with rollout.max_staleness >= 1; set it, or drop rollout.partial"
            )
        if self.max_staleness and self.release_memory:
            raise UserError(
                "rollout.max_staleness > 0 generates while the trainer trains, which "
                "rollout.release_memory (the servers' GPU memory lent to training) rules out; "
                "set one of them to 0, or place the servers on GPUs of their own"
            )


def check_url(url: str, key: str) -> None:
    """An http(s) URL with a host and, if it names one, a port in 1..65535."""
    try:
        parts = urlsplit(url)
        port = parts.port  # (a ValueError for a port out of range or not a number)
    except ValueError:
        parts, port = None, None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname or port == 0:
        raise UserError(
            f"{key} must be an http(s) URL with a host, like http://10.0.0.2:30000, not {show(url)}"
        )


@dataclass
class EnvSection:
    """Multi-turn rollouts: with `fn` set, a rollout is an episode. The model writes a turn, the
    environment answers it (tokens the model is not trained on), until the environment says done,
    `max_turns` model turns or `max_tokens` tokens after the prompt (rollout/episodes.py)."""

    # tools: the built-in tool-calling environment (Qwen3 <tool_call> blocks, `tools` below);
    # module:function_or_class (or file.py:...): your own, called with each data row
    fn: str | None = None
    # tool names (calc), module:function or path/to/file.py:function (as env.fn's)
    tools: list[str] = field(default_factory=list)
    max_turns: int = 4
    max_turn_tokens: int | None = None  # a model turn's limit (null: rollout.max_new_tokens)
    max_tokens: int = 512  # model and environment tokens of an episode, after the prompt
    # a call into the environment's code (at least 0.01 s); past it, the episode ends
    timeout_s: float = 30.0
    # a worker's start: importing the environment and its tools (a model they load), at most this
    start_timeout_s: float = 120.0
    # worker processes the episodes live in (rollout/env.py; null: 16, or one per core if more)
    workers: int | None = None

    def check(self) -> None:
        if self.fn is not None:  # (tools: the built-in tool-calling environment)
            plugin_spec(self.fn, "env.fn", ("tools",), "function_or_class")
        if self.fn == "tools" and not self.tools:
            raise UserError(
                "env.fn tools needs env.tools: tool names (calc), module:function or path/to/file.py:function"
            )
        if self.tools and self.fn != "tools":
            raise UserError("env.tools is used by env.fn=tools only; set env.fn=tools or drop it")
        for name in ("max_turns", "max_tokens"):
            positive(getattr(self, name), f"env.{name}")
        if self.max_turn_tokens is not None:
            positive(self.max_turn_tokens, "env.max_turn_tokens")
        seconds(self.timeout_s, "env.timeout_s", at_least=MIN_CALL_SECONDS)
        seconds(self.start_timeout_s, "env.start_timeout_s")
        if self.workers is not None:
            in_range(self.workers, "env.workers", 1, 1024)
