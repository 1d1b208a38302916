"""Test helper: a learner with one engine switch on, trained beside the same learner without it."""

from __future__ import annotations

import pytest
import torch

from flashsac_opt import FlashSACConfig, FlashSACLearner
from flashsac_opt.testing.oracle import synthetic_batch


def assert_trains_as_the_composite_under_bf16(switch: str, mode: str) -> None:
    """The recipe's shapes (B256, critic 256 wide) on CUDA in ``mode``: 4 iterations of 8 updates with
    and without ``switch``, from one seed; the switched learner's metrics finite, its critic loss and
    parameters within bf16 drift of the composite path's."""
    dims = {"obs_dim": 98, "critic_obs_dim": 101, "action_dim": 29}
    learners = []
    for on in (False, True):
        torch.manual_seed(0)
        cfg = FlashSACConfig(learner_mode=mode, batch_size=256, updates_per_step=8, **{switch: on})
        learners.append(FlashSACLearner(cfg, **dims, device=torch.device("cuda")))
    for learner in learners:
        torch.manual_seed(1)
        for i in range(4):
            learner.update(synthetic_batch(256 * 8, 98, 101, 29, torch.Generator().manual_seed(i), device=torch.device("cuda")))
    m, m_switched = (learner.read_metrics() for learner in learners)
    assert all(torch.isfinite(torch.tensor(v)) for v in m_switched.values() if isinstance(v, float))
    assert m_switched["Loss/critic"] == pytest.approx(m["Loss/critic"], rel=2e-2)
    drift = (learners[1].critic.params - learners[0].critic.params).abs().max().item()
    assert drift < 2e-2, drift
