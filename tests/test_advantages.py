"""The advantage estimators on a scored rollout, checked against hand-worked numbers."""

import time

import pytest
import torch
from helpers import BASE

from lmppo.inputs.config import load_config
from lmppo.inputs.resolve import resolve
from lmppo.math import core
from lmppo.sampling.rollout import EstimatedRollout, Rollout, ScoredRollout
from lmppo.training.advantages import advantages_of
from lmppo.training.step_results import RewardEstimates


def estimate(
    response_mask: list[list[float]], kl_per_token: float, scores: list[float], *overrides: str
) -> tuple[EstimatedRollout, RewardEstimates]:
    """The estimator on a scored rollout whose every response token has ``logp_old - logp_ref =
    kl_per_token`` (k1), with beta 0.5."""
    mask = torch.tensor(response_mask)
    rows, width = mask.shape
    logp_old = torch.full((rows, width), -1.0)
    sampled = Rollout(
        query_ids=torch.ones(rows, 1, dtype=torch.long),
        query_mask=torch.ones(rows, 1, dtype=torch.long),
        response_ids=torch.ones(rows, width, dtype=torch.long),
        response_mask=mask,
        terminated=torch.ones(rows, dtype=torch.bool),
        logp_old=logp_old,
        policy_version=0,
        created_at=time.time(),
        prompts=["p"] * rows,
        response_texts=[""] * rows,
    )
    logp_ref = logp_old - kl_per_token
    scored = ScoredRollout.after(
        sampled,
        rm_score=torch.tensor(scores),
        logp_ref=logp_ref,
        kl_ref=torch.where(mask.bool(), core.kl_estimate(logp_old, logp_ref), 0.0),  # as scoring stores it
        values=torch.zeros(rows, width),
    )
    cfg = load_config(
        base=BASE, overrides=["kl.beta=0.5", "rollout.batch_size=2", "ppo.minibatch_size=1", *overrides]
    )
    return advantages_of(scored, 0.5, resolve(cfg, device="cpu").estimator)


def test_rloo_takes_the_other_samples_mean_and_sums_the_kl_penalty_to_go():
    """Two prompts, two samples each: scores (1, 2) and (3, 6), so leave-one-out gives (-1, 1, -3, 3);
    each response token pays -beta * 0.2 = -0.1, and each token's advantage is its reward-to-go."""
    estimated, estimates = estimate(
        [[1, 1], [1, 0], [1, 1], [1, 1]],
        0.2,
        [1.0, 2.0, 3.0, 6.0],
        "ppo.advantage=rloo",
        "rollout.samples_per_prompt=2",
    )
    expected = torch.tensor([[-1.2, -1.1], [0.9, 0.0], [-3.2, -3.1], [2.8, 2.9]])
    torch.testing.assert_close(estimated.advantages, expected)  # not whitened: already on the group's scale
    torch.testing.assert_close(estimated.returns, expected)  # no critic: the return is the advantage
    assert estimates.flat_groups.tolist() == [False] * 4
    torch.testing.assert_close(estimated.rm_score, torch.tensor([1.0, 2.0, 3.0, 6.0]))  # logged unbaselined


@pytest.mark.parametrize(("advantage", "scale"), [("grpo", 0.5**0.5), ("dr_grpo", 1.0)])
def test_grpo_divides_by_the_group_std_and_dr_grpo_does_not(advantage, scale):
    """Scores (0, 2): centred (-1, 1), and the unbiased std of two samples 2 apart is sqrt(2); no KL."""
    estimated, estimates = estimate(
        [[1, 1], [1, 1]],
        0.0,
        [0.0, 2.0],
        f"ppo.advantage={advantage}",
        "rollout.samples_per_prompt=2",
        "rollout.batch_size=1",
    )
    expected = torch.tensor([[-scale, -scale], [scale, scale]])
    torch.testing.assert_close(estimated.advantages, expected, atol=1e-5, rtol=1e-5)


def test_reinforce_pp_whitens_the_kl_shaped_return_over_the_batch():
    """Scores (1, 0), -0.1 per token: returns (0.8, 0.9) and (-0.2, -0.1); whitened with their mean 0.35
    and population std 0.502."""
    estimated, estimates = estimate([[1, 1], [1, 1]], 0.2, [1.0, 0.0], "ppo.advantage=reinforce_pp")
    returns = torch.tensor([[0.8, 0.9], [-0.2, -0.1]])
    torch.testing.assert_close(estimated.returns, returns)
    std = ((returns - 0.35) ** 2).mean().sqrt()
    torch.testing.assert_close(estimated.advantages, (returns - 0.35) / std, atol=1e-5, rtol=1e-5)


def test_reinforce_pp_baseline_centres_each_group_then_whitens_over_the_batch():
    """REINFORCE++-baseline (the group's mean, the batch's std): scores (1, 3) and (10, 10) centre to
    (-1, 1) and (0, 0); -0.1 per token gives returns (-1.2, -1.1), (0.8, 0.9), (-0.2, -0.1) twice, whitened
    over all eight tokens (the flat group keeps its KL term, and the batch's std, not its own, scales it)."""
    estimated, estimates = estimate(
        [[1, 1]] * 4,
        0.2,
        [1.0, 3.0, 10.0, 10.0],
        "ppo.advantage=reinforce_pp_baseline",
        "rollout.samples_per_prompt=2",
    )
    returns = torch.tensor([[-1.2, -1.1], [0.8, 0.9], [-0.2, -0.1], [-0.2, -0.1]])
    torch.testing.assert_close(estimated.returns, returns)
    mean, std = returns.mean(), returns.std(unbiased=False)
    torch.testing.assert_close(estimated.advantages, (returns - mean) / std, atol=1e-5, rtol=1e-5)
    assert estimates.flat_groups.tolist() == [False, False, True, True]


def test_a_group_that_scored_alike_is_flat_and_gets_only_the_kl_term():
    estimated, estimates = estimate(
        [[1, 1], [1, 1], [1, 1], [1, 1]],
        0.2,
        [1.0, 1.0, 0.0, 3.0],
        "ppo.advantage=rloo",
        "rollout.samples_per_prompt=2",
    )
    assert estimates.flat_groups.tolist() == [True, True, False, False]
    torch.testing.assert_close(estimated.advantages[:2], torch.tensor([[-0.2, -0.1], [-0.2, -0.1]]))


def test_decoupled_lambdas_give_the_policy_its_own_advantages_and_the_critic_the_reward_to_go():
    """GAE with V = 0, scores (1, 0) and -0.1 per token: lam_policy 0 leaves each token its own reward
    (-0.1, 0.9), lam_critic 1 makes the returns the reward-to-go (0.8, 0.9); length_adaptive with alpha 1
    gives a 2-token row lambda 0.5."""
    base = ("ppo.whiten_advantages=false", "ppo.lam_critic=1.0")
    estimated, _ = estimate([[1, 1], [1, 1]], 0.2, [1.0, 0.0], "ppo.lam_policy=0.0", *base)
    torch.testing.assert_close(estimated.advantages, torch.tensor([[-0.1, 0.9], [-0.1, -0.1]]))
    torch.testing.assert_close(estimated.returns, torch.tensor([[0.8, 0.9], [-0.2, -0.1]]))
    adaptive, _ = estimate(
        [[1, 1], [1, 1]], 0.2, [1.0, 0.0], "ppo.lam_policy=length_adaptive", "ppo.lam_alpha=1.0", *base
    )
    torch.testing.assert_close(adaptive.advantages, torch.tensor([[0.35, 0.9], [-0.15, -0.1]]))
