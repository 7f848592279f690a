"""Rewards: the exact-answer and math-verify checks, plugins by module:function or file path,
scoring a batch (a plugin that raises or returns junk is a clear error), dynamic sampling."""

import sys
import threading

import numpy as np
import pytest

from megatron_gspo.errors import UserError
from megatron_gspo.rewards import dynamic_sampling_keep, load_reward, score_rewards

pytestmark = pytest.mark.unit


def test_exact_ignores_whitespace_only():
    exact = load_reward("exact")
    assert exact("what is 7 + 5 + 3 ?", "1 5", "15") == 1.0
    assert exact("", " 1 2 3\n", "123") == 1.0
    for wrong in ("1 6", "5", "1 5 .", "", "15 15"):
        assert exact("", wrong, "15") == 0.0


@pytest.mark.parametrize(
    "response, answer, expected",
    [
        ("so the total is \\boxed{15}", "15", 1.0),
        ("1 5", "15", 1.0),  # digits decoded one word each
        ("first 3, then 4", "4", 1.0),  # the last number
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("it is 1/2", "$\\frac{1}{2}$", 1.0),
        ("\\boxed{16}", "15", 0.0),
        ("no number here", "15", 0.0),
        ("15", "not math ((", 0.0),
    ],
)
def test_math(response, answer, expected):
    assert load_reward("math")("", response, answer) == expected


def test_math_off_the_main_thread():
    results = []
    thread = threading.Thread(target=lambda: results.append(load_reward("math")("", "1 5", "15")))
    thread.start()
    thread.join()
    assert results == [1.0]


PLUGIN = """
CALLS = []
def length(prompt, response, answer):
    CALLS.append(prompt)
    return len(response) / 10
def boom(prompt, response, answer):
    if prompt == "bad":
        raise ValueError("no answer")
    return 1
def junk(prompt, response, answer):
    return {"a": float("nan"), "b": "1.0", "c": None}.get(prompt, 0.5)
NOT_A_FUNCTION = 3
"""


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    pkg = tmp_path / "myrewards"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "mod.py").write_text(PLUGIN)
    (pkg / "other.py").write_text("raise RuntimeError('must not be imported')\n")
    (pkg / "broken.py").write_text("import no_such_dependency_xyz\n")
    (pkg / "raises.py").write_text("raise RuntimeError('bad config')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield pkg
    for name in [m for m in sys.modules if m.startswith("myrewards")]:
        del sys.modules[name]


def test_plugin_by_module_and_by_file(plugin_dir):
    fn = load_reward("myrewards.mod:length")
    assert fn("p", "abcd", "x") == pytest.approx(0.4)
    assert "myrewards.other" not in sys.modules  # only the named module is imported
    by_file = load_reward(f"{plugin_dir / 'mod.py'}:length")
    assert by_file("p", "abcdef", "x") == pytest.approx(0.6)
    assert by_file is not fn  # its own module, not the package's


@pytest.mark.parametrize(
    "spec, message",
    [
        ("nope", "unknown reward 'nope'; use exact, math, or module:function"),
        ("myrewards.missing:fn", "cannot import 'myrewards.missing'.*PYTHONPATH"),
        ("nopkg_xyz.mod:fn", "cannot import 'nopkg_xyz.mod'.*PYTHONPATH"),
        (
            "myrewards.broken:fn",
            "cannot import 'myrewards.broken'.*install 'no_such_dependency_xyz'",
        ),
        ("myrewards.raises:fn", "importing 'myrewards.raises' raised RuntimeError: bad config"),
        ("myrewards.mod:nothing", "has no attribute 'nothing'"),
        ("myrewards.mod:NOT_A_FUNCTION", "'NOT_A_FUNCTION' is a int, not callable"),
        ("myrewards.mod:", "write it as module:function"),
        ("/no/such/file.py:fn", "file '/no/such/file.py' does not exist"),
    ],
)
def test_plugin_load_errors(plugin_dir, spec, message):
    with pytest.raises(UserError, match=message):
        load_reward(spec)


def test_score_rewards_values_and_errors(plugin_dir):
    items = [("p0", "ab", "x"), ("p1", "", "x"), ("p2", "abcde", "x")]
    got = score_rewards(load_reward("myrewards.mod:length"), items, "length")
    assert got == [0.2, 0.0, 0.5] and all(type(v) is float for v in got)
    assert score_rewards(lambda p, r, a: np.float32(0.25), items[:1], "np") == [0.25]
    assert score_rewards(lambda p, r, a: True, items[:1], "bool") == [1.0]

    boom = load_reward("myrewards.mod:boom")
    bad = [("ok", "", ""), ("ok", "", ""), ("bad", "", "")]
    with pytest.raises(UserError, match="reward 'my:boom' raised ValueError: no answer on item 2"):
        score_rewards(boom, bad, "my:boom")
    junk = load_reward("myrewards.mod:junk")
    for prompt, shown in (("a", "nan"), ("b", "'1.0'"), ("c", "None")):
        with pytest.raises(UserError, match=f"returned {shown} .* on item 0.*finite number"):
            score_rewards(junk, [(prompt, "", "")], "junk")


def test_dynamic_sampling_keep():
    rng = np.random.default_rng(0)
    rewards = rng.integers(0, 2, size=(50, 4)).astype(float)
    rewards[3] = 1.0  # all right
    rewards[7] = 0.0  # all wrong
    keep = dynamic_sampling_keep(rewards.flatten().tolist(), 4)
    assert keep == np.flatnonzero(rewards.std(axis=1) > 0).tolist()
    assert 3 not in keep and 7 not in keep
    assert dynamic_sampling_keep([0.5, 0.5, 0.2, 0.7], 2) == [1]
    with pytest.raises(ValueError, match="do not split into groups of 4"):
        dynamic_sampling_keep([1.0] * 6, 4)
