"""How `-n 2` (README's test command, CI; `--dist load` or `loadgroup`) hands out tests: a
module whose module fixtures are costly runs whole on one worker, so such a fixture (a
distributed run of every layout, a server) is built once rather than once on each worker; every
other test is handed out on its own, as xdist's `--dist load` does. (xdist 3.8's own loadgroup, which reads `xdist_group` marks, groups nothing
under pytest 9: it renames the items through an attribute pytest 9 no longer reads.)"""

from __future__ import annotations

from xdist.scheduler import LoadScopeScheduling

ONE_WORKER_MODULES = frozenset(
    {
        "tests/distributed/test_routing.py",  # every layout's run: 70 s
        "tests/distributed/test_shard.py",  # three layouts' steps: 57 s
        "tests/distributed/test_actor.py",  # the layouts' runs: 39 s
        "tests/distributed/test_grouped_experts.py",  # the layouts' runs: 26 s
        "tests/distributed/test_lora.py",
        "tests/distributed/test_lm_head.py",
        "tests/distributed/test_expert_loop.py",
        "tests/distributed/test_score_layouts.py",
        "tests/contract/test_sglang_routing.py",  # a server's rollouts and a trained run: 24-49 s
        "tests/contract/test_server_contract.py",  # the SGLang server: 40 s
        "tests/contract/test_sglang_weight_sync.py",  # the SGLang server: 30 s
    }
)


class ModuleGroups(LoadScopeScheduling):
    """Scopes: the module for ONE_WORKER_MODULES, the test itself otherwise (largest first)."""

    def _split_scope(self, nodeid: str) -> str:
        module = nodeid.split("::", 1)[0]
        return module if module in ONE_WORKER_MODULES else nodeid
