"""The KL penalty in the reward (algo.kl_in: reward, train/reward_kl.py) against the formula
written out here, on random batches: KL_i = sum_t mask * k(old, ref); r'_i = r_i - beta KL_i;
A_i = (r'_i - mean_g r') / (std_g r' + eps), or r'_i - mean_g r' without the std."""

import math

import pytest
import torch

from megatron_gspo.algo.config import AlgoConfig
from megatron_gspo.train.batch import StepBatch
from megatron_gspo.train.reward_kl import apply_reward_kl
from megatron_gspo.train.samples import to_batch


def random_batch(seed: int, groups: int, G: int) -> StepBatch:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(5, 12, (groups * G,), generator=g).tolist()
    tokens = [torch.randint(3, 50, (n,), generator=g).tolist() for n in lens]
    prompt = [int(torch.randint(1, 4, (1,), generator=g)) for _ in lens]
    mask = [[0] * p + [1] * (n - p) for p, n in zip(prompt, lens, strict=True)]
    batch = StepBatch.from_rows(tokens, mask, [0.0] * len(lens))
    T = batch.num_tokens
    old = -torch.rand(T, generator=g, dtype=torch.float64) * 3
    ref = old + 0.3 * torch.randn(T, generator=g, dtype=torch.float64)
    starts = batch.cu_seqlens[:-1]
    old[starts], ref[starts] = math.nan, math.nan  # (entry 0: no log-prob)
    batch.set("old_logprobs", old)
    batch.set("ref_logprobs", ref)
    batch.set("rewards", torch.randint(0, 2, (len(lens),), generator=g).double())
    return batch


def estimator(kind: str, old: float, ref: float) -> float:
    log_r = ref - old  # log pi_ref / pi
    return {"k1": -log_r, "k2": log_r**2 / 2, "k3": math.exp(log_r) - 1 - log_r}[kind]


def expected(batch: StepBatch, kind: str, beta: float, G: int, by_std: bool):
    old, ref = batch.row_values("old_logprobs"), batch.row_values("ref_logprobs")
    mask, rewards = batch.row_values("loss_mask"), batch["rewards"].tolist()
    kl = [
        sum(estimator(kind, o, r) for o, r, m in zip(os, rs, ms, strict=True) if m)
        for os, rs, ms in zip(old, ref, mask, strict=True)
    ]
    tokens = sum(sum(m) for m in mask)
    shaped = [r - beta * k for r, k in zip(rewards, kl, strict=True)]
    adv = []
    for start in range(0, len(shaped), G):
        group = shaped[start : start + G]
        mean = sum(group) / G
        std = math.sqrt(sum((x - mean) ** 2 for x in group) / (G - 1))
        m = max(abs(x) for x in group) or 1.0  # (advantages.py scales by it: eps's unit)
        adv += [(x - mean) / (std + 1e-6 * m) if by_std else x - mean for x in group]
    return adv, sum(kl) / tokens, beta * sum(kl) / len(kl)


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
@pytest.mark.parametrize("adv_norm", ["std", "none"])
def test_advantages_of_the_penalized_rewards_are_the_formula(kind, adv_norm):
    G, beta = 4, 0.2
    batch = random_batch(seed=len(kind) + len(adv_norm), groups=3, G=G)
    algo = AlgoConfig(loss="grpo", kl_coef=beta, kl_estimator=kind, kl_in="reward",
                      adv_norm=adv_norm)  # fmt: skip
    metrics = apply_reward_kl(batch, algo, G)
    adv, kl_ref, penalty = expected(batch, kind, beta, G, adv_norm == "std")
    torch.testing.assert_close(
        batch["advantages"].double(), torch.tensor(adv, dtype=torch.float64), atol=1e-5, rtol=0
    )
    assert metrics["kl/ref"] == pytest.approx(kl_ref, rel=1e-9)
    assert metrics["kl/reward_penalty"] == pytest.approx(penalty, rel=1e-9)
    assert penalty > 0.01 or kind == "k1"  # (k1 may sum to either sign)


def test_no_kl_leaves_the_group_advantages_of_the_rewards():
    """Old log-probs equal to the reference's (the first step): the rewards' own advantages."""
    G = 4
    batch = random_batch(seed=7, groups=2, G=G)
    batch.set("ref_logprobs", batch["old_logprobs"].clone())
    apply_reward_kl(batch, AlgoConfig(kl_coef=0.5, kl_in="reward", kl_estimator="k1"), G)
    adv, _, _ = expected(batch, "k1", 0.0, G, True)
    torch.testing.assert_close(
        batch["advantages"].double(), torch.tensor(adv, dtype=torch.float64), atol=1e-6, rtol=0
    )


def test_a_batch_without_rewards_is_refused():
    batch = random_batch(seed=1, groups=1, G=2)
    batch = batch.without("rewards")
    with pytest.raises(ValueError, match="needs the batch's rewards"):
        apply_reward_kl(batch, AlgoConfig(kl_coef=0.1, kl_in="reward"), 2)


def test_the_producers_batch_carries_its_rewards_in_fp64():
    """to_batch keeps the rewards the advantages came from (fp64: 1e200 stays finite)."""
    from megatron_gspo.rollout.sample import Sample

    samples = [Sample(prompt_index=0, sample_index=i, prompt_ids=[1, 2], tokens=[3, 4],
                      logprobs=[-0.1, -0.2]) for i in range(2)]  # fmt: skip
    batch = to_batch(samples, [1.0, -1.0], [1e200, -1e200])
    assert batch["rewards"].dtype == torch.float64
    assert batch["rewards"].tolist() == [1e200, -1e200]


def test_the_loss_has_no_kl_term_when_the_kl_is_in_the_reward():
    assert AlgoConfig(kl_coef=0.1).kl_in_loss
    assert not AlgoConfig(kl_coef=0.1, kl_in="reward").kl_in_loss
    assert AlgoConfig(kl_coef=0.1, kl_in="reward").kl_in_reward
    assert not AlgoConfig(kl_coef=0.0, kl_in="reward").kl_in_reward
