"""lmppo.math.core against independent oracles: brute force, plain Python, Monte Carlo, the seeds'
examples."""

import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import given, settings
from hypothesis import strategies as st

from lmppo.math import core


def ragged_mask(batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """A (B, L) response mask: each row 1 on a prefix of random length (at least one row non-empty)."""
    lengths = torch.randint(0, length + 1, (batch,), generator=gen)
    lengths[0] = max(int(lengths[0]), 1)
    return (torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)).float()


# --------------------------------------------------------------------------------------------------
# Masked statistics
# --------------------------------------------------------------------------------------------------


def test_masked_stats_match_plain_statistics_of_the_kept_entries():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 9, generator=gen)
    mask = ragged_mask(5, 9, gen)
    kept = x[mask.bool()]
    assert torch.allclose(core.masked_sum(x, mask), kept.sum())
    assert torch.allclose(core.masked_mean(x, mask), kept.mean())
    assert torch.allclose(core.masked_var(x, mask, unbiased=True), kept.var(unbiased=True))
    assert torch.allclose(core.masked_var(x, mask, unbiased=False), kept.var(unbiased=False))
    expected = (kept - kept.mean()) / (kept.std(unbiased=False) + 1e-8)
    whitened = core.masked_whiten(x, mask)
    assert torch.allclose(whitened[mask.bool()], expected, atol=1e-6)
    assert torch.all(whitened[~mask.bool()] == 0)
    unshifted = core.masked_whiten(x, mask, shift_mean=False)
    assert torch.allclose(unshifted[mask.bool()], expected + kept.mean(), atol=1e-6)


def test_padding_values_never_change_masked_statistics():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 7, generator=gen)
    mask = ragged_mask(4, 7, gen)
    garbage = x.clone()
    garbage[~mask.bool()] = float("nan")
    garbage[~mask.bool()][::2] = float("inf")
    for fn in (core.masked_sum, core.masked_mean, core.masked_var):
        assert torch.equal(fn(x, mask), fn(garbage, mask)), fn.__name__
    assert torch.equal(core.masked_whiten(x, mask), core.masked_whiten(garbage, mask))


def test_all_masked_batch_gives_zeros_not_nan():
    x = torch.randn(3, 4)
    empty = torch.zeros(3, 4)
    for value in (core.masked_sum(x, empty), core.masked_mean(x, empty), core.masked_var(x, empty)):
        assert value.item() == 0.0
    assert torch.all(core.masked_whiten(x, empty) == 0)
    assert core.explained_variance(x, x, empty).item() == 0.0
    loss, clip = core.ppo_clip_loss(x, x, x, empty, 0.2)
    assert loss.item() == 0.0 and clip.item() == 0.0
    one_entry = torch.zeros(3, 4)
    one_entry[0, 0] = 1.0
    assert core.masked_var(x, one_entry).item() == 0.0  # a single entry has no (unbiased) variance


@settings(max_examples=40, deadline=None)
@given(
    batch=st.integers(1, 6),
    length=st.integers(1, 12),
    seed=st.integers(0, 10_000),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_masked_whiten_property(batch, length, seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(batch, length, generator=gen) * 3 + 1).to(dtype)
    mask = ragged_mask(batch, length, gen)
    out = core.masked_whiten(x, mask)
    assert out.dtype == dtype and out.shape == x.shape
    assert torch.all(out[~mask.bool()] == 0)
    kept = out[mask.bool()].float()
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    if kept.numel() > 1 and x[mask.bool()].float().std() > 1e-3:
        assert abs(kept.mean().item()) < tol * max(1.0, kept.abs().max().item())
        assert abs(kept.std(unbiased=False).item() - 1.0) < 10 * tol


def _global_stats_worker(rank: int, world: int, port: int, shards, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    x, mask = shards[rank]
    group = dist.group.WORLD
    results[rank] = (
        core.masked_mean(x, mask, group),
        core.masked_var(x, mask, group=group),
        core.masked_whiten(x, mask, group=group),
        core.explained_variance(x * 0.5, x, mask, group=group),
    )
    dist.destroy_process_group()


@pytest.mark.distributed
def test_global_statistics_over_two_ranks_equal_statistics_of_the_concatenation():
    gen = torch.Generator().manual_seed(2)
    # Shards with different widths and lengths, as ranks with different response lengths would have.
    shards = [
        (torch.randn(3, 5, generator=gen), ragged_mask(3, 5, gen)),
        (torch.randn(2, 8, generator=gen), ragged_mask(2, 8, gen)),
    ]
    with mp.Manager() as manager:
        results = manager.dict()
        port = 29500 + os.getpid() % 1000
        mp.spawn(_global_stats_worker, args=(2, port, shards, results), nprocs=2, join=True)
        results = dict(results)
    kept = torch.cat([x[m.bool()] for x, m in shards])
    expected_white = (kept - kept.mean()) / (kept.std(unbiased=False) + 1e-8)
    whitened = torch.cat([results[r][2][shards[r][1].bool()] for r in range(2)])
    for rank in range(2):
        assert torch.allclose(results[rank][0], kept.mean(), atol=1e-6)
        assert torch.allclose(results[rank][1], kept.var(), atol=1e-6)
    assert torch.allclose(whitened, expected_white, atol=1e-5)
    residual = kept * 0.5
    assert torch.allclose(
        results[0][3], 1 - residual.var(unbiased=False) / kept.var(unbiased=False), atol=1e-5
    )


# --------------------------------------------------------------------------------------------------
# Log-probs, entropy, KL
# --------------------------------------------------------------------------------------------------


def test_token_logprobs_and_entropy_match_log_softmax():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 5, 11, generator=gen) * 4
    labels = torch.randint(0, 11, (2, 5), generator=gen)
    logp = torch.log_softmax(logits, -1)
    assert torch.allclose(
        core.token_logprobs(logits, labels), logp.gather(-1, labels[..., None])[..., 0], atol=1e-5
    )
    assert torch.allclose(core.token_entropy(logits), -(logp.exp() * logp).sum(-1), atol=1e-5)
    mask = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1]]).float()
    expected = (-(logp.exp() * logp).sum(-1))[mask.bool()].mean()
    assert torch.allclose(core.masked_entropy(logits, mask), expected, atol=1e-5)


def composed_logprobs_and_entropy(logits, labels):
    """The reference: autograd through log_softmax, gather and softmax, all (B, L, V) at once."""
    logp = torch.log_softmax(logits, -1)
    return logp.gather(-1, labels[..., None])[..., 0], -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("chunk_elements", [2**22, 7 * 11])  # one chunk; 7 rows a chunk (a ragged last one)
def test_chunked_logprobs_and_entropy_and_their_gradients_match_autograd(monkeypatch, chunk_elements):
    monkeypatch.setattr(core, "VOCAB_CHUNK_ELEMENTS", chunk_elements)
    gen = torch.Generator().manual_seed(4)
    logits = (torch.randn(3, 6, 11, generator=gen) * 4).requires_grad_()
    labels = torch.randint(0, 11, (3, 6), generator=gen)
    weights = torch.randn(2, 3, 6, generator=gen)
    expected = composed_logprobs_and_entropy(logits, labels)
    got = core.token_logprobs_and_entropy(logits, labels)
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=0)
    for terms in ([0], [1], [0, 1]):  # the log-prob loss, the entropy bonus, both
        grads = [
            torch.autograd.grad(sum((w * out[i]).sum() for i, w in zip(terms, weights[terms])), logits)[0]
            for out in (
                composed_logprobs_and_entropy(logits, labels),
                core.token_logprobs_and_entropy(logits, labels),
            )
        ]
        torch.testing.assert_close(grads[1], grads[0], atol=1e-5, rtol=0)


def test_token_logprobs_are_autograds_bit_for_bit_and_so_is_the_gradient_up_to_softmax_rounding():
    """The stored log-probs are autograd's gather - logsumexp bit for bit; the gradient reads ``p`` from one
    fused softmax instead of ``exp(z - logsumexp(z))``, a last-bit difference."""
    gen = torch.Generator().manual_seed(5)
    logits = (torch.randn(4, 9, 50, generator=gen) * 3).requires_grad_()
    labels = torch.randint(0, 50, (4, 9), generator=gen)
    weights = torch.randn(4, 9, generator=gen)
    composed = logits.gather(-1, labels[..., None])[..., 0] - torch.logsumexp(logits, -1)
    chunked = core.token_logprobs(logits, labels)
    assert torch.equal(chunked, composed)
    (expected,) = torch.autograd.grad((weights * composed).sum(), logits)
    (got,) = torch.autograd.grad((weights * chunked).sum(), logits)
    torch.testing.assert_close(got, expected, atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_temperature_inside_the_sweep_equals_dividing_the_logits_first(dtype):
    """Temperature and the float32 cast per chunk: the values and gradients of ``logits.float() / T``."""
    gen = torch.Generator().manual_seed(6)
    logits = (torch.randn(3, 5, 40, generator=gen) * 3).to(dtype).requires_grad_()
    labels = torch.randint(0, 40, (3, 5), generator=gen)
    weights = torch.randn(2, 3, 5, generator=gen)
    outputs = (
        core.token_logprobs_and_entropy(logits, labels, temperature=0.7),
        composed_logprobs_and_entropy(logits.float() / 0.7, labels),
    )
    for got, expected in zip(*outputs):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    got, expected = (
        torch.autograd.grad((weights[0] * logp).sum() + (weights[1] * entropy).sum(), logits)[0]
        for logp, entropy in outputs
    )
    assert got.dtype == dtype
    torch.testing.assert_close(
        got.float(), expected.float(), atol=1e-5 if dtype == torch.float32 else 1e-2, rtol=0
    )


def test_kl_estimators_k3_nonnegative_and_k1_k3_share_expectation():
    gen = torch.Generator().manual_seed(4)
    logp, logp_ref = torch.randn(64, 32, generator=gen), torch.randn(64, 32, generator=gen)
    assert torch.all(core.kl_estimate(logp, logp_ref, "k3") >= 0)
    assert torch.allclose(core.kl_estimate(logp, logp_ref, "k2"), 0.5 * (logp - logp_ref) ** 2)
    assert torch.all(core.kl_estimate(logp, logp, "k3") == 0)
    with pytest.raises(ValueError, match="k1"):
        core.kl_estimate(logp, logp_ref, "k4")
    # Monte Carlo on a small categorical: both estimators are unbiased for KL(p || q) under samples of p.
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    q = torch.tensor([0.25, 0.25, 0.25, 0.25])
    exact = float((p * (p / q).log()).sum())
    samples = torch.multinomial(p, 200_000, replacement=True, generator=gen)
    logp_s, logq_s = p.log()[samples], q.log()[samples]
    k1 = core.kl_estimate(logp_s, logq_s, "k1").mean().item()
    k3 = core.kl_estimate(logp_s, logq_s, "k3").mean().item()
    assert abs(k1 - exact) < 0.01 and abs(k3 - exact) < 0.01


def test_approx_kl_is_k3_of_old_to_new():
    logp_old = torch.tensor([[-1.0, -2.0, -0.5]])
    logp_new = torch.tensor([[-1.2, -1.5, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    ratio = (logp_new - logp_old).exp()[:, :2]
    expected = ((ratio - 1) - ratio.log()).mean()
    assert torch.allclose(core.approx_kl(logp_new, logp_old, mask), expected)
    assert core.approx_kl(logp_old, logp_old, mask).item() == 0.0


# --------------------------------------------------------------------------------------------------
# Shaped rewards (the worked example of docs/core.md)
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("beta", "expected"),
    [
        (0.1, [-0.02, 0.0, 0.10, 1.50]),
        (0.2, [-0.04, 0.0, 0.20, 1.50]),
    ],
)
def test_seed_worked_example(beta, expected):
    logp_old = torch.tensor([[-1.0, -0.5, -2.0, -0.1]])
    logp_ref = torch.tensor([[-1.2, -0.5, -1.0, -0.1]])
    mask = torch.ones(1, 4)
    rewards = core.shaped_rewards(torch.tensor([1.5]), core.kl_estimate(logp_old, logp_ref), mask, beta)
    assert torch.allclose(rewards, torch.tensor([expected]), atol=1e-6)
    assert math.isclose(rewards.sum().item(), 1.58 if beta == 0.1 else 1.66, abs_tol=1e-6)


def test_shaped_rewards_places_score_and_kl():
    logp_old = torch.tensor([[-1.0, -2.0, -3.0, 7.0], [-0.5, -0.5, 5.0, 5.0]])
    logp_ref = torch.tensor([[-1.0, -1.0, -1.0, float("nan")], [-0.5, -1.5, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    score = torch.tensor([2.0, -1.0])
    rewards = core.shaped_rewards(score, core.kl_estimate(logp_old, logp_ref), mask, beta=0.5)
    # Row 0: KL terms -0.5 * (0, -1, -2); score on index 2 (the last response token, not the first pad).
    assert torch.allclose(rewards[0], torch.tensor([0.0, 0.5, 1.0 + 2.0, 0.0]))
    # Row 1: KL terms -0.5 * (0, 1); score on index 1.
    assert torch.allclose(rewards[1], torch.tensor([0.0, -0.5 - 1.0, 0.0, 0.0]))
    # Where policy == reference the KL term vanishes and only the score remains.
    same = core.shaped_rewards(score, core.kl_estimate(logp_old, logp_old), mask, beta=0.5)
    assert torch.allclose(same, torch.tensor([[0, 0, 2.0, 0], [0, -1.0, 0, 0]]))
    # k3 penalties are never positive rewards.
    k3 = core.shaped_rewards(torch.zeros(2), core.kl_estimate(logp_old, logp_ref, "k3"), mask, 0.5)
    assert torch.all(k3 <= 0)


def test_last_response_index_rows_of_every_shape():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [0, 1, 1, 0]])
    assert core.last_response_index(mask).tolist() == [2, 0, 3, 0, 2]
    empty_row_reward = core.shaped_rewards(torch.tensor([5.0]), torch.zeros(1, 3), torch.zeros(1, 3), 0.1)
    assert torch.all(empty_row_reward == 0)


# --------------------------------------------------------------------------------------------------
# GAE
# --------------------------------------------------------------------------------------------------


def brute_force_gae(rewards, values, mask, gamma, lam, bootstrap):
    """Plain-Python oracle: for each row, A_t = sum_l (gamma*lam)^l delta_{t+l} over its response prefix."""
    adv = torch.zeros_like(rewards)
    for b in range(rewards.shape[0]):
        n = int(mask[b].sum())
        vals = [float(values[b, t]) for t in range(n)] + [float(bootstrap[b])]
        deltas = [float(rewards[b, t]) + gamma * vals[t + 1] - vals[t] for t in range(n)]
        for t in range(n):
            adv[b, t] = sum((gamma * lam) ** k * deltas[t + k] for k in range(n - t))
    return adv


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 0.95), (0.9, 0.8), (1.0, 1.0), (0.99, 0.0)])
def test_gae_matches_brute_force_and_mc_return(gamma, lam):
    gen = torch.Generator().manual_seed(5)
    rewards, values = torch.randn(6, 10, generator=gen), torch.randn(6, 10, generator=gen)
    mask = ragged_mask(6, 10, gen)
    bootstrap = torch.randn(6, generator=gen)
    adv, ret = core.gae(rewards, values, mask, gamma, lam, bootstrap_value=bootstrap)
    assert torch.allclose(adv, brute_force_gae(rewards, values, mask, gamma, lam, bootstrap), atol=1e-5)
    assert torch.allclose(ret, (adv + values) * mask, atol=1e-6)
    # lambda = gamma = 1 without bootstrap: A + V is the Monte-Carlo reward-to-go.
    adv1, ret1 = core.gae(rewards * mask, values, mask, 1.0, 1.0)
    reward_to_go = (rewards * mask).flip(1).cumsum(1).flip(1) * mask
    assert torch.allclose(ret1, reward_to_go, atol=1e-5)
    assert torch.allclose(adv1 + values * mask, reward_to_go, atol=1e-5)


@pytest.mark.parametrize(("lam_policy", "lam_critic"), [(0.95, 1.0), (0.5, 0.9), (1.0, 0.0)])
def test_decoupled_gae_is_two_brute_force_sums_in_one_pass(lam_policy, lam_critic):
    """VC-PPO: the advantages take the policy's lambda, the returns the critic's (A(lam_critic) + V); with
    lam_critic = 1 the returns are the discounted reward-to-go plus the discounted bootstrap."""
    gen = torch.Generator().manual_seed(7)
    rewards, values = torch.randn(6, 10, generator=gen), torch.randn(6, 10, generator=gen)
    mask, bootstrap, gamma = ragged_mask(6, 10, gen), torch.randn(6, generator=gen), 0.97
    adv, ret = core.gae(rewards, values, mask, gamma, lam_policy, bootstrap, lam_critic=lam_critic)
    assert torch.allclose(
        adv, brute_force_gae(rewards, values, mask, gamma, lam_policy, bootstrap), atol=1e-5
    )
    critic = brute_force_gae(rewards, values, mask, gamma, lam_critic, bootstrap)
    assert torch.allclose(ret, (critic + values) * mask, atol=1e-5)
    if lam_critic == 1.0:
        lengths = mask.sum(1).long()
        for b, n in enumerate(lengths.tolist()):
            for t in range(n):
                to_go = sum(gamma**k * rewards[b, t + k].item() for k in range(n - t))
                assert math.isclose(
                    ret[b, t].item(), to_go + gamma ** (n - t) * bootstrap[b].item(), abs_tol=1e-4
                )


def test_length_adaptive_lambda_is_a_per_row_gae():
    """VAPO: lambda = 1 - 1 / (alpha * length) per row, and GAE with a (B,) lambda is each row's own GAE."""
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1] * 6, [1, 0, 0, 0, 0, 0]]).float()
    lam = core.length_adaptive_lam(mask, alpha=0.5)
    assert torch.allclose(lam, torch.tensor([0.5, 1 - 1 / 3, 0.0]))
    gen = torch.Generator().manual_seed(8)
    rewards, values = torch.randn(3, 6, generator=gen), torch.randn(3, 6, generator=gen)
    adv, _ = core.gae(rewards, values, mask, 1.0, lam)
    for b in range(3):
        row, _ = core.gae(rewards[b : b + 1], values[b : b + 1], mask[b : b + 1], 1.0, lam[b].item())
        assert torch.allclose(adv[b], row[0], atol=1e-6)


def test_gae_padding_never_leaks_and_bootstrap_only_for_truncated_rows():
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    values = torch.tensor([[0.1, 0.2, 0.3, 0.0], [0.5, 0.5, 0.5, 0.5]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    terminated = torch.tensor([True, False])
    bootstrap = torch.where(terminated, 0.0, torch.tensor([99.0, 2.0]))  # row 0's 99 must not be used
    adv, ret = core.gae(rewards, values, mask, 1.0, 1.0, bootstrap_value=bootstrap)
    padded_values = values.clone()
    padded_values[0, 3] = 1e30  # huge padding values change nothing
    padded_rewards = rewards.clone()
    padded_rewards[0, 3] = float("nan")
    adv2, ret2 = core.gae(padded_rewards, padded_values, mask, 1.0, 1.0, bootstrap_value=bootstrap)
    assert torch.equal(adv, adv2) and torch.equal(ret, ret2)
    assert torch.allclose(ret[0], torch.tensor([1.0, 1.0, 1.0, 0.0]))  # terminated: return = reward-to-go
    assert torch.allclose(ret[1], torch.full((4,), 2.0))  # truncated: the bootstrap value carries back
    assert adv[0, 3] == 0 and ret[0, 3] == 0


def test_gae_skips_holes_of_every_length_as_one_credit_path():
    """Multi-turn episodes put context tokens (tool output, template glue) between the policy's actions. GAE
    over the actions skips those holes: credit flows from an action to the previous action across any hole,
    never reset there (the seeds' reference recursion resets at masked positions and would cut credit at
    every tool call). Every mask of 7 positions, each a row; what the holes hold is never read."""
    length, gamma, lam = 7, 0.9, 0.8
    masks = torch.tensor(
        [[(m >> t) & 1 for t in range(length)] for m in range(2**length)], dtype=torch.float32
    )
    gen = torch.Generator().manual_seed(11)
    rewards, values = torch.randn(masks.shape, generator=gen), torch.randn(masks.shape, generator=gen)
    bootstrap = torch.randn(len(masks), generator=gen)
    adv, ret = core.gae(rewards, values, masks, gamma, lam, bootstrap_value=bootstrap)
    for row, mask in enumerate(masks):
        actions = mask.nonzero().flatten().tolist()  # the credit path: the actions in order, holes left out
        expected = brute_force_gae(
            rewards[row, actions][None],
            values[row, actions][None],
            torch.ones(1, len(actions)),
            gamma,
            lam,
            bootstrap[row : row + 1],
        )[0]
        assert torch.allclose(adv[row, actions], expected, atol=1e-5), mask
        assert torch.all(adv[row][mask == 0] == 0) and torch.all(ret[row][mask == 0] == 0)
    holes = masks == 0  # NaN in every hole changes nothing
    adv_nan, ret_nan = core.gae(
        rewards.masked_fill(holes, float("nan")),
        values.masked_fill(holes, float("nan")),
        masks,
        gamma,
        lam,
        bootstrap_value=bootstrap,
    )
    assert torch.equal(adv_nan, adv) and torch.equal(ret_nan, ret)


# --------------------------------------------------------------------------------------------------
# Losses
# --------------------------------------------------------------------------------------------------


def test_ppo_clip_loss_gradient_and_clipping():
    gen = torch.Generator().manual_seed(6)
    logp_old = torch.randn(3, 5, generator=gen)
    adv = torch.randn(3, 5, generator=gen)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]]).float()
    logp_new = logp_old.clone().requires_grad_(True)
    loss, clip_frac = core.ppo_clip_loss(logp_new, logp_old, adv, mask, 0.2)
    assert torch.allclose(loss, -adv[mask.bool()].mean()) and clip_frac.item() == 0.0
    loss.backward()
    # At ratio 1 the gradient is the vanilla policy gradient: -A_t / (number of response tokens).
    assert torch.allclose(logp_new.grad, -adv * mask / mask.sum(), atol=1e-7)

    def grad_at(log_ratio: float, advantage: float) -> float:
        lp = torch.tensor([[log_ratio]], requires_grad=True)
        loss, _ = core.ppo_clip_loss(
            lp, torch.zeros(1, 1), torch.tensor([[advantage]]), torch.ones(1, 1), 0.2
        )
        loss.backward()
        return lp.grad.item()

    up, down = math.log(1.5), math.log(0.5)
    assert grad_at(up, 1.0) == 0.0  # pushed past 1+eps in the advantage's direction: clipped
    assert grad_at(down, -1.0) == 0.0  # pushed below 1-eps with negative advantage: clipped
    assert grad_at(down, 1.0) < 0.0  # wrong direction is never clipped: the step can be undone
    assert grad_at(up, -1.0) > 0.0
    _, frac = core.ppo_clip_loss(
        torch.tensor([[up, 0.0, down, 5.0]]),
        torch.zeros(1, 4),
        torch.ones(1, 4),
        torch.tensor([[1.0, 1.0, 1.0, 0.0]]),
        0.2,
    )
    assert math.isclose(frac.item(), 2 / 3, rel_tol=1e-6)


def test_clip_higher_widens_only_the_upper_bound():
    """DAPO's clip-higher: with [1 - 0.2, 1 + 0.28] a ratio of 1.25 with a positive advantage still gets
    its gradient (it is clipped at 1.2 without), a ratio of 0.75 with a negative one is clipped as before."""

    def grad_and_frac(log_ratio: float, advantage: float, high: float | None) -> tuple[float, float]:
        lp = torch.tensor([[log_ratio]], requires_grad=True)
        loss, frac = core.ppo_clip_loss(
            lp, torch.zeros(1, 1), torch.tensor([[advantage]]), torch.ones(1, 1), 0.2, clip_eps_high=high
        )
        loss.backward()
        return lp.grad.item(), frac.item()

    assert grad_and_frac(math.log(1.25), 1.0, None) == (0.0, 1.0)
    grad, frac = grad_and_frac(math.log(1.25), 1.0, 0.28)
    assert math.isclose(grad, -1.25, rel_tol=1e-6) and frac == 0.0
    assert grad_and_frac(math.log(0.75), -1.0, 0.28) == (0.0, 1.0)
    assert grad_and_frac(math.log(1.3), 1.0, 0.28) == (0.0, 1.0)


def test_truncated_importance_weights_scale_each_tokens_surrogate():
    logp_engine = torch.log(torch.tensor([[0.5, 0.2, 0.1, 0.3]]))
    logp_trainer = torch.log(torch.tensor([[0.5, 0.3, 0.4, 0.3]]))
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    weights = core.truncated_importance_weights(logp_trainer, logp_engine, mask, cap=2.0)
    torch.testing.assert_close(weights, torch.tensor([[1.0, 1.5, 2.0, 0.0]]))  # 0.4/0.1 = 4 is capped at 2
    adv = torch.tensor([[1.0, -2.0, 3.0, 7.0]])
    logp_new = logp_trainer.clone().requires_grad_(True)  # ratio 1 against the trainer's log-probs
    loss, _ = core.ppo_clip_loss(logp_new, logp_trainer, adv, mask, 0.2, token_weights=weights)
    assert math.isclose(loss.item(), -(1.0 * 1.0 + 1.5 * -2.0 + 2.0 * 3.0) / 3, rel_tol=1e-6)
    unweighted, _ = core.ppo_clip_loss(logp_new, logp_trainer, adv, mask, 0.2, token_weights=torch.ones(1, 4))
    assert unweighted.item() == core.ppo_clip_loss(logp_new, logp_trainer, adv, mask, 0.2)[0].item()


def test_value_loss_clipping():
    old = torch.tensor([[0.0, 0.0, 0.0, 0.0]])
    returns = torch.tensor([[1.0, 1.0, -1.0, 0.0]])
    values = torch.tensor([[0.5, 0.1, 0.5, 100.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    loss, clip_frac = core.value_loss(values, old, returns, mask, clip_eps=0.2)
    # Token 0: max((0.5-1)^2, (0.2-1)^2) = 0.64; token 1: unclipped 0.81; token 2: max(2.25, 1.44) = 2.25.
    assert torch.allclose(loss, torch.tensor(0.5 * (0.64 + 0.81 + 2.25) / 3))
    assert math.isclose(clip_frac.item(), 2 / 3, rel_tol=1e-6)
    loss.backward()
    # Token 0's clipped branch wins: no gradient; token 2's unclipped branch wins: gradient flows.
    assert (
        values.grad[0, 0] == 0
        and values.grad[0, 1] != 0
        and values.grad[0, 2] != 0
        and values.grad[0, 3] == 0
    )


def test_explained_variance():
    returns = torch.tensor([[1.0, 2.0, 3.0, 50.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    assert torch.allclose(core.explained_variance(returns, returns, mask), torch.tensor(1.0))
    assert torch.allclose(
        core.explained_variance(torch.full_like(returns, 2.0), returns, mask), torch.tensor(0.0)
    )
    assert core.explained_variance(-returns, returns, mask).item() < 0


# --------------------------------------------------------------------------------------------------
# KL controllers
# --------------------------------------------------------------------------------------------------


def test_kl_controller_moves_beta_toward_target():
    ctl = core.AdaptiveKLController(beta=0.1, target=6.0, horizon=10)
    assert math.isclose(ctl.update(12.0), 0.1 * (1 + 0.2 / 10))  # error clipped at +0.2
    assert math.isclose(ctl.update(6.0), 0.1 * (1 + 0.2 / 10))  # on target: unchanged
    before = ctl.value
    assert math.isclose(ctl.update(3.0, n_steps=2), before * (1 - 0.2 * 2 / 10))  # error clipped at -0.2
    # Repeated feedback from a system whose KL falls as beta rises converges toward the target.
    ctl = core.AdaptiveKLController(beta=0.01, target=4.0, horizon=5)
    for _ in range(400):
        ctl.update(0.4 / ctl.value)  # KL = 0.4 / beta: the target is reached at beta = 0.1
    assert math.isclose(ctl.value, 0.1, rel_tol=0.02)
    fixed = core.FixedKLController(0.05)
    assert fixed.update(100.0) == 0.05
    restored = core.AdaptiveKLController(1.0, 4.0, 5)
    restored.load_state_dict(ctl.state_dict())
    assert restored.value == ctl.value
    with pytest.raises(ValueError):
        core.AdaptiveKLController(0.1, 0.0, 10)


def test_gae_keeps_float64_precision():
    rewards = torch.tensor([[1e-9, 0.0, 1.0]], dtype=torch.float64)
    values = torch.tensor([[1.0 + 1e-12, 0.5, 0.25]], dtype=torch.float64)
    mask = torch.ones(1, 3)
    advantages, returns = core.gae(rewards, values, mask, gamma=1.0, lam=1.0)
    assert advantages.dtype == torch.float64
    expected = rewards.sum() - values[0, 0]  # with gamma = lam = 1, A_0 is the return minus V_0
    assert abs(advantages[0, 0].item() - expected.item()) < 1e-15  # fp32 would be off by ~1e-7


# --------------------------------------------------------------------------------------------------
# Critic-free baselines (worked by hand)
# --------------------------------------------------------------------------------------------------


def test_group_advantages_worked_examples():
    """Two prompts, two samples each: scores (1, 2) and (3, 6)."""
    scores = torch.tensor([1.0, 2.0, 3.0, 6.0])
    half = 0.5**0.5  # deviation / unbiased std of any two distinct samples
    torch.testing.assert_close(
        core.group_advantages(scores, 2, "mean_std"), torch.tensor([-half, half, -half, half])
    )
    torch.testing.assert_close(core.group_advantages(scores, 2, "mean"), torch.tensor([-0.5, 0.5, -1.5, 1.5]))
    # leave-one-out: each score minus the other sample's
    torch.testing.assert_close(
        core.group_advantages(scores, 2, "leave_one_out"), torch.tensor([-1.0, 1.0, -3.0, 3.0])
    )
    # three samples: 0 - (3+6)/2, 3 - (0+6)/2, 6 - (0+3)/2
    torch.testing.assert_close(
        core.group_advantages(torch.tensor([0.0, 3.0, 6.0]), 3, "leave_one_out"),
        torch.tensor([-4.5, 0.0, 4.5]),
    )
    assert (
        core.group_advantages(torch.tensor([2.0, 2.0]), 2, "mean_std").eq(0).all()
    )  # no spread: no signal, no NaN


def test_group_advantages_refuse_partial_or_single_sample_groups():
    for rows, size in ((5, 2), (4, 1)):
        with pytest.raises(ValueError, match="whole groups of >= 2"):
            core.group_advantages(torch.zeros(rows), size, "leave_one_out")


def test_discounted_returns_worked_example_skips_masked_positions():
    rewards = torch.tensor([[1.0, 2.0, 3.0], [1.0, 99.0, 3.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 1.0]])
    # row 0: G1 = 2, G0 = 1 + 0.5 * 2; row 1: the masked 99 is never read, G2 = 3, G0 = 1 + 0.5 * 3
    expected = torch.tensor([[2.0, 2.0, 0.0], [2.5, 0.0, 3.0]])
    torch.testing.assert_close(core.discounted_returns(rewards, mask, gamma=0.5), expected)


def test_flat_groups_marks_every_row_of_a_group_that_scored_alike():
    flat = core.flat_groups(torch.tensor([1.0, 1.0, 0.0, 2.0, 3.0, 3.0]), 2)
    assert flat.tolist() == [True, True, False, False, True, True]


def test_sequence_mean_weights_make_a_token_mean_the_mean_of_the_rows_means():
    """Rows of 1 and 3 tokens (mean length 2): weights 2 and 2/3; the token mean of w * x is the mean of
    (4) and (1 + 2 + 3) / 3 = 2, i.e. 3, where the plain token mean is (4 + 6) / 4 = 2.5."""
    x = torch.tensor([[4.0, 0.0, 0.0], [1.0, 2.0, 3.0]])
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    weights = core.sequence_mean_weights(mask, 2.0)
    torch.testing.assert_close(weights[:, 0], torch.tensor([2.0, 2.0 / 3.0]))
    assert core.masked_mean(x * weights, mask).item() == pytest.approx(3.0)
    assert core.masked_mean(x, mask).item() == pytest.approx(2.5)
    halved = core.sequence_mean_weights(mask, 2.0, token_weights=torch.full((2, 3), 0.5))
    torch.testing.assert_close(halved, weights * 0.5)


def test_sequence_ratio_is_one_per_response_with_gspo_tokens_gradient():
    """GSPO: each row's tokens share s = exp(mean log-ratio); the gradient on token t is -s * A / N (the
    token-mean over N tokens) while unclipped, and a row whose s leaves [1 - eps, 1 + eps] is clipped whole,
    even where its own tokens' ratios stay inside."""
    logp_old = torch.zeros(2, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    log_ratio = torch.tensor([[0.1, -0.1, 9.0], [0.1, 0.15, 0.35]])  # row 1: mean 0.2, s = e^0.2 > 1.2
    logp_new = log_ratio.clone().requires_grad_(True)
    adv = torch.ones(2, 3)
    loss, clip_frac = core.ppo_clip_loss(logp_new, logp_old, adv, mask, 0.2, sequence_ratio=True)
    loss.backward()
    assert math.isclose(loss.item(), -(2 * 1.0 + 3 * 1.2) / 5, rel_tol=1e-6)  # row 0: s = 1; row 1: clipped
    torch.testing.assert_close(logp_new.grad, torch.tensor([[-0.2, -0.2, 0.0], [0.0, 0.0, 0.0]]))
    assert math.isclose(clip_frac.item(), 3 / 5, rel_tol=1e-6)
    token_level, _ = core.ppo_clip_loss(log_ratio, logp_old, adv, mask, 0.2)
    assert not math.isclose(token_level.item(), loss.item())  # per token, 0.35 alone is clipped


def test_overlong_fraction_rises_over_the_buffer_before_the_limit():
    """DAPO: limit 20, buffer 4: nothing up to 16 tokens, then a quarter per token, all of it at 20."""
    lengths = torch.tensor([3, 16, 17, 18, 20])
    assert core.overlong_fraction(lengths, limit=20, buffer=4).tolist() == [0.0, 0.0, 0.25, 0.5, 1.0]
