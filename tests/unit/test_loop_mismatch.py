"""The loop's train-vs-rollout gap, and its split by rollout-vs-trainer routing agreement (R3)."""

import numpy as np
import pytest

from megatron_gspo.routing.storage import SampleRouting
from megatron_gspo.train.batch import RLBatch
from megatron_gspo.train.loop import mismatch_metrics

pytestmark = pytest.mark.unit


def _batch(with_flags: bool) -> RLBatch:
    # token-aligned lists (entry 0 belongs to the first prompt token and is never trained on)
    tokens = [[1, 2, 3, 4, 5], [1, 2, 3, 4]]
    mask = [[0, 0, 1, 1, 1], [0, 1, 1, 0]]
    old = [[None, -1.0, -2.0, -3.0, -4.0], [None, -1.0, -1.5, -9.0]]
    roll = [[None, -1.5, -2.5, -3.0, -4.25], [None, -1.25, -1.0, -1.0]]
    batch = RLBatch(tokens, mask, [0.0, 0.0], old_logprobs=old, rollout_logprobs=roll)
    if with_flags:
        routing = [SampleRouting((1,)), SampleRouting((1,))]
        # per POSITION: token t was produced at position t - 1
        routing[0].rollout_differs = np.array([False, True, False, True, False])
        routing[1].rollout_differs = np.array([True, False, False, False])
        batch.routing = routing
    return batch


def test_gap_over_trained_tokens():
    # trained: sample 0 tokens 2, 3, 4 (|diffs| 0.5, 0, 0.25); sample 1 tokens 1, 2 (0.25, 0.5)
    assert mismatch_metrics(_batch(False)) == {"mismatch/logprob_abs_diff": pytest.approx(1.5 / 5)}


def test_gap_split_by_routing_agreement():
    # sample 0: token 2 <- position 1 (differs) 0.5; token 3 <- position 2 (same) 0.0;
    # token 4 <- position 3 (differs) 0.25. sample 1: token 1 <- position 0 (differs) 0.25;
    # token 2 <- position 1 (same) 0.5.
    out = mismatch_metrics(_batch(True))
    assert out["mismatch/logprob_abs_diff"] == pytest.approx(1.5 / 5)
    assert out["mismatch/logprob_abs_diff_routing_differs"] == pytest.approx(1.0 / 3)
    assert out["mismatch/logprob_abs_diff_routing_same"] == pytest.approx(0.5 / 2)
