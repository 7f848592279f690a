"""The algo and reward keys of the run config for the new objectives, corrections and shaping:
parsing, each loss's published defaults, one-line errors naming the fix; and DAPO's over-long
penalty against the paper's formula."""

import pytest

from megatron_gspo.algo.config import DEFAULT_CLIP, Level, LossKind, Mismatch
from megatron_gspo.config import load_config
from megatron_gspo.errors import UserError
from megatron_gspo.rewards.overlong import overlong_penalty, shape_overlong

pytestmark = pytest.mark.unit


def _load(tmp_path, *overrides):
    path = tmp_path / "c.yaml"
    path.write_text("model: {path: m}\nrollout: {max_new_tokens: 32}\n")
    return load_config(path, list(overrides))


def test_each_loss_gets_its_published_clip_range_unless_given(tmp_path):
    for kind in LossKind:
        algo = _load(tmp_path, f"algo.loss={kind}").algo
        assert algo.clip == DEFAULT_CLIP[kind] and (algo.clip_low, algo.clip_high) == (None, None)
        assert (algo.loss_kwargs()["clip_low"], algo.loss_kwargs()["clip_high"]) == algo.clip
    assert DEFAULT_CLIP[LossKind.CISPO][0] == 1.0  # MiniMax-M1: no lower bound on the weight
    given = _load(tmp_path, "algo.loss=cispo", "algo.clip_high=4.0").algo
    assert given.clip == (1.0, 4.0)
    sapo = _load(tmp_path, "algo.loss=sapo").algo
    assert (sapo.sapo_tau_pos, sapo.sapo_tau_neg) == (1.0, 1.05)  # the paper's


def test_adv_norm_mismatch_and_norm_aggregation_parse(tmp_path):
    cfg = _load(tmp_path, "algo.adv_norm=none", "algo.agg=seq-mean-token-sum-norm",
                "algo.norm_length=32", "algo.mismatch=mis", "algo.mismatch_level=sequence",
                "algo.mis_low=0.5", "algo.mis_high=3")  # fmt: skip
    assert cfg.algo.advantage_std_norm is False
    assert cfg.algo.norm_length == 32 and cfg.algo.correction == (Mismatch.MIS, Level.SEQUENCE)
    assert _load(tmp_path).algo.advantage_std_norm is True
    legacy = _load(tmp_path, "algo.tis=sequence").algo  # the earlier key keeps working
    assert legacy.correction == (Mismatch.TIS, Level.SEQUENCE)
    icepop = _load(tmp_path, "algo.mismatch=icepop", "algo.mismatch_level=sequence")
    assert icepop.algo.correction == (Mismatch.ICEPOP, Level.TOKEN)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["algo.adv_norm=mean"], "algo.adv_norm must be one of"),
        (["algo.loss=sapo2"], "algo.loss must be one of"),
        (["algo.mismatch=rs"], "algo.mismatch must be one of"),
        (["algo.agg=seq-mean-token-sum-norm"], "set algo.norm_length"),
        (["algo.tis=token", "algo.mismatch=icepop"], "'algo.tis' is the earlier name of"),
        (["algo.sapo_tau_neg=0"], "algo.sapo_tau_neg"),
        (["algo.icepop_k=1"], "algo.icepop_k"),
        (["algo.mis_low=2", "algo.mis_high=1"], "algo.mis_high"),
        (["algo.clip_low=1.5"], "algo.clip_low"),
        (["reward.overlong_buffer=40"], "rollout.max_new_tokens"),
        (["reward.overlong_penalty=-1"], "reward.overlong_penalty"),
        (["algo.advantage_std_norm=false"], "unknown config key 'algo.advantage_std_norm'"),
    ],
)
def test_bad_values_are_one_line_errors(tmp_path, overrides, message):
    with pytest.raises(UserError, match=message) as e:
        _load(tmp_path, *overrides)
    assert "\n" not in str(e.value)


def test_overlong_penalty_is_dapos_formula():
    """DAPO (arXiv 2503.14476) eq. 13, L = limit, L_cache = buffer:
    0 if |y| <= L - L_cache; ((L - L_cache) - |y|) / L_cache if L - L_cache < |y| <= L; -1 if
    |y| > L; times the penalty factor."""
    L, buf, k = 20, 8, 0.5
    for n in range(0, 25):
        want = 0.0 if n <= L - buf else ((L - buf) - n) / buf if n <= L else -1.0
        assert overlong_penalty(n, L, buf, k) == pytest.approx(k * want), n
    assert overlong_penalty(L, L, buf) == -1.0 and overlong_penalty(L - buf, L, buf) == 0.0
    assert overlong_penalty(L, L, 0) == 0.0  # off
    assert shape_overlong([1.0, 0.0], [L, 3], L, buf) == [0.0, 0.0]
    with pytest.raises(ValueError, match="exceeds"):
        overlong_penalty(3, 4, 5)
