"""The PPO-for-language-models math: pure tensor functions, no models, files or config.

Conventions (see docs/core.md for the formulas with a worked example):
- Per-token tensors are ``(B, L)``. In a rollout ``L`` is the response length ``R`` and position ``t``
  is response token ``t``; the functions work on any layout (e.g. a full-sequence ``(B, T-1)``) given a mask.
- ``mask`` / ``response_mask`` is ``(B, L)``, 1 where a position counts. A masked position never changes
  a result, whatever it holds (padding garbage, ``inf``, ``nan``): values are selected with
  ``torch.where``, never multiplied by the mask. An all-masked batch gives 0, never a division by zero.
- Statistics accumulate in float32 and are returned in the input dtype.
- ``group``: an optional ``torch.distributed`` process group; when given, sums and counts are
  all-reduced over it so means, variances and whitening use every rank's tokens (global statistics).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist

KLEstimator = Literal["k1", "k2", "k3"]


# --------------------------------------------------------------------------------------------------
# Masked reductions (global over a process group when one is given)
# --------------------------------------------------------------------------------------------------


def _all_reduce_sum(t: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def _sum_and_count(x: torch.Tensor, mask: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 ``(sum of x over mask, number of masked-in positions)``, reduced over ``group``."""
    keep = mask.bool()
    stats = torch.stack([torch.where(keep, x.float(), 0.0).sum(), keep.sum().float()])  # one all-reduce
    stats = _all_reduce_sum(stats, group)
    return stats[0], stats[1]


def masked_sum(x: torch.Tensor, mask: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Sum of ``x`` over positions where ``mask`` is 1. ``x``, ``mask``: (B, L) -> scalar."""
    total, _ = _sum_and_count(x, mask, group)
    return total.to(x.dtype)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Mean of ``x`` over the mask; 0 when nothing is masked in. (B, L) -> scalar."""
    total, count = _sum_and_count(x, mask, group)
    return (total / count.clamp(min=1.0)).to(x.dtype)


def masked_var(
    x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Variance of ``x`` over the mask (Bessel-corrected when ``unbiased``); 0 with fewer than 2 entries.

    (B, L) -> scalar. Two passes (mean, then squared deviations) for accuracy.
    """
    total, count = _sum_and_count(x, mask, group)
    mean = total / count.clamp(min=1.0)
    sq_dev, _ = _sum_and_count((x.float() - mean) ** 2, mask, group)
    dof = count - 1.0 if unbiased else count
    var = torch.where(count > 1.0, sq_dev / dof.clamp(min=1.0), torch.zeros_like(sq_dev))
    return var.to(x.dtype)


def masked_whiten(
    x: torch.Tensor,
    mask: torch.Tensor,
    shift_mean: bool = True,
    group: dist.ProcessGroup | None = None,
    eps: float = 1e-8,
) -> torch.Tensor:
    """``(x - mean) / (std + eps)`` with mean and (population) std over the mask; 0 where masked.

    With ``shift_mean=False`` the mean is added back (only the scale changes). (B, L) -> (B, L).
    Population std (divided by the token count); with a process group, over all ranks' tokens.
    """
    mean = masked_mean(x.float(), mask, group)
    std = masked_var(x.float(), mask, unbiased=False, group=group).sqrt()
    whitened = (x.float() - mean) / (std + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask.bool(), whitened, 0.0).to(x.dtype)


# --------------------------------------------------------------------------------------------------
# Log-probs, entropy, KL estimators
# --------------------------------------------------------------------------------------------------


VOCAB_CHUNK_ELEMENTS = 2**22  # rows of logits handled at once: 16 MiB of float32 temporaries per chunk


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``log softmax(logits / temperature)[labels]`` per position. ``logits`` (B, L, V), ``labels`` (B, L)
    -> (B, L).

    The label logit minus ``logsumexp``, in float32 (bf16 log-probs are too coarse for importance
    ratios), a chunk of rows at a time: see :func:`token_logprobs_and_entropy`.
    """
    return _VocabTerms.apply(logits, labels, False, temperature)[0]


def token_logprobs_and_entropy(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of ``labels`` and the entropy of ``softmax(z)``, ``z = logits / temperature``, per
    position. -> (B, L), (B, L).

    ``H = logsumexp(z) - sum_v p_v z_v``. Both come from one sweep over the vocabulary, a chunk of
    positions at a time, and so does the backward (``d logp / dz = onehot - p``,
    ``dH / dz = -p (z - E_p[z])``, recomputed from the logits): with a 49k vocabulary the update holds
    the logits and their gradient, never the several (B, L, V) intermediates of autograd's
    ``logsumexp``, ``softmax`` and ``gather``. The temperature and the float32 cast of bf16 logits are
    applied per chunk too, so neither makes a (B, L, V) copy. The results equal those composed ops to
    float rounding. Autocast is off inside: the sweep is float32 by design.
    """
    return _VocabTerms.apply(logits, labels, True, temperature)


class _VocabTerms(torch.autograd.Function):
    """``token_logprobs_and_entropy``'s forward and backward, row chunk by row chunk."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, with_entropy: bool, temperature: float):
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(logits, labels)
        ctx.temperature = temperature
        flat, flat_labels = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1, 1)
        logp = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
        entropy = torch.empty_like(logp) if with_entropy else None
        with torch.autocast(logits.device.type, enabled=False):
            for rows in _row_chunks(flat):
                z = _tempered_chunk(flat[rows], temperature)
                lse = torch.logsumexp(z, dim=-1)
                logp[rows] = z.gather(-1, flat_labels[rows]).squeeze(-1) - lse
                if with_entropy:
                    entropy[rows] = lse - torch.einsum("nv,nv->n", torch.softmax(z, dim=-1), z)
        shape = labels.shape
        return logp.view(shape), entropy.view(shape) if with_entropy else torch.zeros(
            shape, device=logits.device
        )

    @staticmethod
    def backward(ctx, grad_logp: torch.Tensor | None, grad_entropy: torch.Tensor | None):
        logits, labels = ctx.saved_tensors
        flat, flat_labels = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1, 1)
        grad = torch.empty_like(flat)
        g_logp = None if grad_logp is None else grad_logp.reshape(-1, 1).float()
        g_entropy = None if grad_entropy is None else grad_entropy.reshape(-1, 1).float()
        for rows in _row_chunks(flat):
            z = _tempered_chunk(flat[rows], ctx.temperature)
            p = torch.softmax(z, dim=-1)
            g = torch.zeros_like(z) if g_logp is None else -p * g_logp[rows]  # onehot(label) g - p g
            if g_logp is not None:
                g.scatter_add_(-1, flat_labels[rows], g_logp[rows])
            if g_entropy is not None:
                expected = torch.einsum("nv,nv->n", p, z).unsqueeze(-1)
                g = g - g_entropy[rows] * p * (z - expected)
            grad[rows] = g if ctx.temperature == 1.0 else g / ctx.temperature  # d z / d logits = 1 / T
        return grad.view(logits.shape), None, None, None


def _tempered_chunk(rows: torch.Tensor, temperature: float) -> torch.Tensor:
    z = rows.float()
    return z if temperature == 1.0 else z / temperature


def _row_chunks(flat: torch.Tensor) -> list[slice]:
    step = max(1, VOCAB_CHUNK_ELEMENTS // max(flat.shape[-1], 1))
    return [slice(i, min(i + step, flat.shape[0])) for i in range(0, flat.shape[0], step)]


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` per position. (B, L, V) -> (B, L); see :func:`token_logprobs_and_entropy`."""
    labels = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
    return token_logprobs_and_entropy(logits, labels)[1]


def masked_entropy(logits: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Mean policy entropy over response positions. ``logits`` (B, L, V), mask (B, L) -> scalar."""
    return masked_mean(token_entropy(logits), response_mask)


def kl_estimate(logp: torch.Tensor, logp_ref: torch.Tensor, kind: KLEstimator = "k1") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from tokens sampled from ``pi``. (B, L) -> (B, L).

    With ``log_ratio = logp - logp_ref``:
    - ``k1 = log_ratio``: unbiased, signed per token (the default, as in TRL; it sums to the sequence KL).
    - ``k2 = 0.5 * log_ratio**2``: low variance, biased.
    - ``k3 = (ratio - 1) - log ratio`` with ``ratio = pi_ref / pi``: unbiased and >= 0 everywhere.
    """
    log_ratio = logp.float() - logp_ref.float()
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio**2
    if kind == "k3":
        return torch.expm1(-log_ratio) + log_ratio  # expm1 keeps precision near ratio = 1
    raise ValueError(f"unknown KL estimator {kind!r}; use 'k1', 'k2' or 'k3'")


def approx_kl(
    logp_new: torch.Tensor, logp_old: torch.Tensor, mask: torch.Tensor, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Mean k3 estimate of KL(pi_old || pi_new) over the mask, for early-stopping PPO epochs.

    Samples come from pi_old, so ``ratio = pi_new / pi_old`` and ``k3 = (ratio - 1) - log ratio``.
    (B, L) -> scalar.
    """
    return masked_mean(kl_estimate(logp_old, logp_new, "k3"), mask, group)


# --------------------------------------------------------------------------------------------------
# Rewards and advantages
# --------------------------------------------------------------------------------------------------


def last_response_index(response_mask: torch.Tensor) -> torch.Tensor:
    """Index of the last position with ``response_mask == 1`` in each row (0 for an empty row).

    (B, L) -> (B,) long.
    """
    positions = torch.arange(response_mask.shape[1], device=response_mask.device)  # (L,)
    return torch.where(response_mask.bool(), positions, -1).amax(dim=1).clamp(min=0)


def shaped_rewards(
    rm_score: torch.Tensor, kl_ref: torch.Tensor, response_mask: torch.Tensor, beta: float
) -> torch.Tensor:
    """Per-token reward ``r_t = -beta * KL_t`` on response tokens, plus ``rm_score`` on the last one.

    Args:
        rm_score: (B,) sequence score (reward model or programmatic reward).
        kl_ref: (B, L) per-token KL estimate to the reference (:func:`kl_estimate` of the sampled tokens).
        response_mask: (B, L) 1 on response tokens up to and including the first EOS.
        beta: KL coefficient.
    Returns:
        (B, L) rewards, zero outside the mask. A row with no response token gets no score.
    """
    keep = response_mask.bool()
    kl_penalty = torch.where(keep, -beta * kl_ref, 0.0)  # (B, L)
    last = last_response_index(response_mask)  # (B,)
    has_response = keep.any(dim=1)  # (B,)
    score = torch.where(has_response, rm_score.float(), 0.0)  # (B,)
    return kl_penalty.index_put((torch.arange(len(last), device=last.device), last), score, accumulate=True)


def overlong_fraction(lengths: torch.Tensor, limit: int, buffer: int) -> torch.Tensor:
    """DAPO's soft overlong punishment, as a share (B,): 0 up to ``limit - buffer`` tokens, then rising
    linearly to 1 at ``limit``; the score loses ``penalty x`` it (``reward.overlong_buffer``)."""
    return ((lengths.float() - (limit - buffer)) / buffer).clamp(min=0.0, max=1.0)


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float | torch.Tensor = 0.95,
    bootstrap_value: torch.Tensor | None = None,
    lam_critic: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the masked positions only.

    ``delta_t = r_t + gamma * V_next - V_t`` and ``A_t = delta_t + gamma * lam * A_next``, where
    "next" is the next *masked-in* position of the row (masked positions are skipped, never read).
    After a row's last response token ``V_next = bootstrap_value`` and ``A_next = 0``.

    Decoupled lambda (VC-PPO): the critic's targets may use their own ``lam_critic``; the same pass
    accumulates both, ``returns = A(lam_critic) + V``. ``lam_critic = 1`` makes the targets the
    discounted reward-to-go plus the bootstrap, unbiased by the critic's own errors.

    Args:
        rewards: (B, L) per-token rewards.
        values: (B, L) ``V(s_t)``, the value of the state before token ``t``.
        response_mask: (B, L).
        gamma: discount per token.
        lam: the advantages' GAE lambda, one for all rows or (B,) per row (VAPO's length-adaptive one).
        bootstrap_value: (B,) value of the state after the last response token: ``V`` of that state
            for a truncated row, 0 for a row that ended with EOS. None means all zeros.
        lam_critic: the returns' lambda; None means ``lam``.
    Returns:
        ``(advantages, returns)``, each (B, L), zero outside the mask; computed in the wider of fp32 and
        the inputs' dtype, returned in ``rewards``' dtype.
    """
    keep = response_mask.bool()
    dtype = torch.promote_types(torch.promote_types(rewards.dtype, values.dtype), torch.float32)  # >= fp32
    rewards_, values_ = rewards.to(dtype), values.to(dtype)
    batch, length = rewards.shape
    next_value = torch.zeros(batch, device=rewards.device, dtype=dtype)
    if bootstrap_value is not None:
        next_value = next_value + bootstrap_value.to(dtype)
    lams = torch.as_tensor(lam, dtype=dtype, device=rewards.device).expand(batch)
    lams = torch.stack([lams, lams if lam_critic is None else torch.full_like(lams, lam_critic)])  # (2, B)
    next_adv = torch.zeros(2, batch, device=rewards.device, dtype=dtype)  # the policy's, the critic's
    advantages = torch.zeros(2, batch, length, device=rewards.device, dtype=dtype)
    for t in reversed(range(length)):  # one vectorised step per position; rows in parallel
        m = keep[:, t]
        delta = rewards_[:, t] + gamma * next_value - values_[:, t]
        adv_t = delta + gamma * lams * next_adv
        next_adv = torch.where(m, adv_t, next_adv)
        next_value = torch.where(m, values_[:, t], next_value)
        advantages[:, :, t] = torch.where(m, adv_t, 0.0)
    returns = torch.where(keep, advantages[1] + values_, 0.0)
    return advantages[0].to(rewards.dtype), returns.to(rewards.dtype)


def length_adaptive_lam(response_mask: torch.Tensor, alpha: float) -> torch.Tensor:
    """VAPO's policy lambda per row, ``1 - 1 / (alpha * length)`` (B,): a long response's advantages sum
    over a longer horizon, so its early tokens still see the final reward; at most 1, at least 0."""
    lengths = response_mask.float().sum(dim=1).clamp(min=1.0)
    return (1.0 - 1.0 / (alpha * lengths)).clamp(min=0.0, max=1.0)


GroupBaseline = Literal["mean_std", "mean", "leave_one_out"]  # what each group baseline subtracts


def group_advantages(
    scores: torch.Tensor, group_size: int, kind: GroupBaseline, eps: float = 1e-6
) -> torch.Tensor:
    """Critic-free sequence advantages from the other samples of the same prompt.

    ``scores`` (B,) holds ``B / group_size`` groups of ``group_size`` consecutive rows, the samples of one
    prompt each (a group is always whole: a statistic over a partial group would be another estimator).
    With group mean ``m`` and unbiased standard deviation ``s`` (as TRL and OpenRLHF compute it):

    - ``mean_std`` (GRPO, Shao et al. 2024, DeepSeekMath): ``(r_i - m) / (s + eps)``;
    - ``mean`` (Dr. GRPO, Liu et al. 2025, "Understanding R1-Zero-Like Training"): ``r_i - m``, without the
      std division, which up-weights prompts whose samples barely differ;
    - ``leave_one_out`` (RLOO, Kool et al. 2019; Ahmadian et al. 2024): ``r_i - mean_{j != i} r_j``
      ``= n / (n - 1) * (r_i - m)``, the leave-one-out baseline, unbiased (it never sees ``r_i``).

    Returns (B,) in ``scores``' dtype, computed in at least fp32. A group of one has no baseline: refused.
    """
    if group_size < 2 or scores.shape[0] % group_size:
        raise ValueError(
            f"group baselines need whole groups of >= 2 samples; got {scores.shape[0]} rows, groups of {group_size}"
        )
    dtype = torch.promote_types(scores.dtype, torch.float32)
    grouped = scores.to(dtype).reshape(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if kind == "mean_std":
        centred = centred / (grouped.std(dim=1, keepdim=True) + eps)
    elif kind == "leave_one_out":
        centred = centred * (group_size / (group_size - 1))
    return centred.reshape(-1).to(scores.dtype)


def flat_groups(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """(B,) bool: the row's group (``group_size`` consecutive rows) scored all alike, so every group baseline
    gives its samples zero advantage and the prompt teaches nothing this step."""
    grouped = scores.reshape(-1, group_size)
    flat = (grouped == grouped[:, :1]).all(dim=1, keepdim=True)
    return flat.expand_as(grouped).reshape(-1)


def discounted_returns(
    rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float = 1.0
) -> torch.Tensor:
    """``G_t = sum_{k >= 0} gamma^k r_{t+k}`` over the masked positions of each row (REINFORCE's return;
    REINFORCE++, Hu 2025, whitens it over the whole batch, :func:`masked_whiten`, as its advantage).
    The same recursion as :func:`gae` with no critic (``V = 0``) and ``lambda = 1``; zero outside the mask."""
    advantages, _ = gae(rewards, torch.zeros_like(rewards), response_mask, gamma=gamma, lam=1.0)
    return advantages


# --------------------------------------------------------------------------------------------------
# Losses and diagnostics
# --------------------------------------------------------------------------------------------------


def ppo_clip_loss(
    logp_new: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_eps: float,
    token_weights: torch.Tensor | None = None,
    clip_eps_high: float | None = None,
    sequence_ratio: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped surrogate ``-mean_t w_t min(r_t A_t, clip(r_t, 1-eps, 1+eps_high) A_t)`` over the mask.

    ``r_t = exp(logp_new - logp_old)`` is formed in log space. All inputs (B, L). ``token_weights``
    ``w_t`` (default 1) are constants, e.g. truncated importance weights for samples drawn by another
    engine than the one ``logp_old`` comes from (:func:`truncated_importance_weights`).
    ``clip_eps_high`` (default ``clip_eps``): DAPO's clip-higher, a wider upper bound, so a token with a
    positive advantage and a low probability can still rise (against entropy collapse).
    ``sequence_ratio``: GSPO's ratio, one per response, ``s = exp(mean_t(logp_new - logp_old))``, given to
    every token of the row as ``sg[s] * pi_t / sg[pi_t]``: the value is ``s``, the gradient ``s * grad logp_t``
    (GSPO-token; with one advantage per row it is GSPO's own gradient), and a row is clipped whole.
    Returns ``(loss, clip_frac)``: token-level mean loss (scalar, differentiable) and the fraction of
    masked tokens whose ratio left ``[1-eps, 1+eps_high]`` (scalar, detached).
    """
    keep = response_mask.bool()
    low, high = 1.0 - clip_eps, 1.0 + (clip_eps if clip_eps_high is None else clip_eps_high)
    log_ratio = torch.where(keep, logp_new.float() - logp_old.float(), 0.0)  # (B, L)
    if sequence_ratio:
        row_mean = log_ratio.sum(1, keepdim=True) / keep.sum(1, keepdim=True).clamp(min=1)  # (B, 1)
        logp = logp_new.float()
        log_ratio = torch.where(keep, row_mean.detach() + logp - logp.detach(), 0.0)
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, low, high) * advantages
    surrogate = -torch.min(unclipped, clipped)
    if token_weights is not None:
        surrogate = surrogate * token_weights.detach()
    loss = masked_mean(surrogate, response_mask)
    clip_frac = masked_mean(((ratio < low) | (ratio > high)).float(), response_mask)
    return loss, clip_frac.detach()


def sequence_mean_weights(
    response_mask: torch.Tensor, mean_length: torch.Tensor | float, token_weights: torch.Tensor | None = None
) -> torch.Tensor:
    """(B, L) weights that turn a token mean into a sequence mean: ``mean_length / len_b`` on row ``b``.

    With ``mean_length`` the minibatch's tokens per row (all ranks: ``T / N``), the token mean of
    ``w * x`` is ``sum_b sum_t x_bt / (N len_b)``, the mean over rows of each row's own token mean, so
    every response weighs the same whatever its length. Multiplied into ``token_weights`` when given.
    """
    lengths = response_mask.sum(dim=1, keepdim=True).clamp(min=1.0)
    weights = (mean_length / lengths).expand_as(response_mask)
    return weights if token_weights is None else weights * token_weights


def truncated_importance_weights(
    logp_target: torch.Tensor, logp_behaviour: torch.Tensor, response_mask: torch.Tensor, cap: float
) -> torch.Tensor:
    """``min(exp(logp_target - logp_behaviour), cap)`` per token (B, L), 0 off the mask.

    Truncated importance sampling (TIS): the tokens were drawn by a behaviour policy (an inference
    engine) whose probabilities differ slightly from the target's (the trainer's forward of the same
    weights); the weight corrects the surrogate's expectation, and the cap bounds its variance.
    """
    log_w = torch.where(response_mask.bool(), logp_target.float() - logp_behaviour.float(), float("-inf"))
    return torch.exp(log_w).clamp(max=cap)


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    clip_eps: float = 0.2,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss ``0.5 * max((V - R)^2, (clip(V, V_old - eps, V_old + eps) - R)^2)``.

    All inputs (B, L); token-level mean over the mask. Returns ``(loss, clip_frac)`` where
    ``clip_frac`` is the fraction of masked tokens with ``|V - V_old| > eps`` (detached).
    """
    values32, old32, returns32 = values.float(), old_values.float(), returns.float()
    v_clipped = old32 + torch.clamp(values32 - old32, -clip_eps, clip_eps)
    per_token = 0.5 * torch.max((values32 - returns32) ** 2, (v_clipped - returns32) ** 2)
    loss = masked_mean(per_token, response_mask)
    clip_frac = masked_mean(((values32 - old32).abs() > clip_eps).float(), response_mask)
    return loss, clip_frac.detach()


def explained_variance(
    values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """``1 - Var(returns - values) / Var(returns)`` over the mask; 0 when ``Var(returns)`` is 0.

    1 is a perfect critic, 0 is no better than a constant, negative is worse. (B, L) -> scalar.
    """
    var_returns = masked_var(returns.float(), mask, unbiased=False, group=group)
    var_residual = masked_var(returns.float() - values.float(), mask, unbiased=False, group=group)
    return torch.where(var_returns > 0, 1.0 - var_residual / var_returns.clamp(min=1e-12), 0.0)


# --------------------------------------------------------------------------------------------------
# KL coefficient controllers
# --------------------------------------------------------------------------------------------------


class FixedKLController:
    """A constant KL coefficient ``beta``."""

    def __init__(self, beta: float) -> None:
        self.value = float(beta)

    def update(self, kl: float, n_steps: int = 1) -> float:
        return self.value

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController(FixedKLController):
    """InstructGPT / Ziegler et al. proportional controller steering the measured KL to ``target``.

    ``e = clip(kl / target - 1, -0.2, 0.2)`` and ``beta <- beta * (1 + e * n_steps / horizon)``:
    KL above target raises beta by at most 20% per ``horizon`` steps, below target lowers it.
    """

    def __init__(self, beta: float, target: float, horizon: float) -> None:
        if target <= 0 or horizon <= 0:
            raise ValueError(
                f"AdaptiveKLController needs target > 0 and horizon > 0, got {target}, {horizon}"
            )
        super().__init__(beta)
        self.target, self.horizon = float(target), float(horizon)

    def update(self, kl: float, n_steps: int = 1) -> float:
        error = min(max(kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
        return self.value
