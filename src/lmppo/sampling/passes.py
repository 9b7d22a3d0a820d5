"""The passes over a rollout: the stored ones, without gradients (the reference's log-probs, the critic's
values, the trainer's own log-probs of an engine's samples), and the update's forward
(:class:`PolicyAndValue`). Each projects only the R positions that predict response tokens
(``logits_to_keep``), and the log-probs and entropy are taken in chunks (:mod:`lmppo.math.core`).
"""

from __future__ import annotations

import torch
from torch import nn

from lmppo.math import core
from lmppo.math.core import last_response_index
from lmppo.modeling.compile import whole_sequences
from lmppo.modeling.models import ValueModel, checkpointed_layers, checkpointing, eval_mode
from lmppo.sampling.rollout import Rollout, stored_pass_batches


def response_logits(model, batch: Rollout, temperature: float | None = None) -> torch.Tensor:
    """Logits predicting each response token, divided by the temperature. -> (B, R, V) float32.

    Row ``t`` comes from the position before response token ``t`` (the last query token for t = 0).
    Only those R positions are projected onto the vocabulary (``logits_to_keep``). Runs with whatever
    grad mode and train/eval mode the caller set. ``temperature`` defaults to the rollout's sampling
    temperature. For log-probs use :func:`response_logprobs`, which never makes this tempered copy.
    """
    out, _ = _response_forward(model, batch)
    return _checked(out.logits, batch).float() / _temperature(batch, temperature)


def response_logprobs(
    model, batch: Rollout, temperature: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of the response tokens and the policy's entropy at each, under ``model`` at
    ``temperature`` (default: the sampling one). -> (B, R), (B, R) float32.

    The forward of :func:`response_logits`; the temperature and the float32 cast happen chunk by chunk
    inside :func:`lmppo.math.core.token_logprobs_and_entropy`. The entropy's backward sweep runs only when a
    loss uses it."""
    out, _ = _response_forward(model, batch)
    logits = _checked(out.logits, batch)
    return core.token_logprobs_and_entropy(logits, batch.response_ids, _temperature(batch, temperature))


def policy_logprobs_and_values(
    policy, value_model: ValueModel, batch: Rollout, temperature: float | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Shared trunk: :func:`response_logprobs`' log-probs and entropy, and values (B, R), from ONE
    backbone pass of the policy.

    ``value_model`` must be ``ValueModel.shared_trunk(policy)``; its head reads the policy's last hidden
    state at the same positions as the logits.
    """
    if not value_model.shared_trunk:
        raise ValueError("policy_logprobs_and_values needs a shared-trunk value model; use value_predictions")
    out, keep = _response_forward(policy, batch, output_hidden_states=True)
    values = value_model.values(out.hidden_states[-1][:, keep])  # (B, R)
    logits = _checked(out.logits, batch)
    logp, entropy = core.token_logprobs_and_entropy(
        logits, batch.response_ids, _temperature(batch, temperature)
    )
    return logp, entropy, values


def _response_forward(model, batch: Rollout, **kwargs):
    """One forward over (query, response), projecting only the R positions that predict response tokens."""
    input_ids, attention_mask, position_ids = batch.sequence_inputs()
    queries, responses = batch.query_ids.shape[1], batch.response_ids.shape[1]
    keep = torch.arange(queries - 1, queries + responses - 1, device=input_ids.device)
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        logits_to_keep=keep,
        use_cache=False,
        **kwargs,
    )
    return out, keep


def _checked(logits: torch.Tensor, batch: Rollout) -> torch.Tensor:
    if logits.shape[1] != batch.response_ids.shape[1]:
        raise TypeError(
            "the model ignored `logits_to_keep`; lmppo needs a transformers causal LM that supports it"
        )
    return logits


def _temperature(batch: Rollout, temperature: float | None) -> float:
    return batch.temperature if temperature is None else temperature


def sequence_logprobs(
    model,
    rollout: Rollout,
    temperature: float | None = None,
    *,
    forward_batch_size: int | None = None,
    forward_batch_tokens: int | None = None,
) -> torch.Tensor:
    """Log-probs of the sampled tokens under ``model`` (B, R) float32, eval mode, no grad.

    The stored reference pass (``logp_ref``), and the trainer's own log-probs of engine samples. The
    temperature defaults to the sampling temperature, so the KL compares like with like. Values at
    masked positions are finite but meaningless. Forwards take ``forward_batch_size`` rows or (trimmed)
    ``forward_batch_tokens`` positions at a time.
    """
    pieces = []
    with torch.inference_mode(), eval_mode(model), whole_sequences():
        for index, mb in stored_pass_batches(rollout, forward_batch_size, forward_batch_tokens):
            pieces.append((index, response_logprobs(model, mb, temperature)[0]))
        logp = scatter_rows(pieces, len(rollout), rollout.response_ids.shape[1])
    return logp.clone()  # a normal tensor: inference tensors cannot meet autograd later


def state_values(value_model: ValueModel, batch: Rollout) -> torch.Tensor:
    """(B, R + 1): V of the state before each response token, then of the state after the last column."""
    return value_model(*batch.sequence_inputs())[:, batch.query_ids.shape[1] - 1 :]


def value_predictions(
    value_model: ValueModel,
    rollout: Rollout,
    *,
    forward_batch_size: int | None = None,
    forward_batch_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stored values for GAE, eval mode, no grad.

    Returns ``values`` (B, R): ``values[:, t] = V(query + response[:t])``, read at the position that
    predicts token t; and ``bootstrap_value`` (B,): V of the state after the row's last response token
    for truncated rows, **0 for terminated rows** (ready for ``core.gae``).
    """
    values, bootstrap = [], []
    with torch.inference_mode(), eval_mode(value_model), whole_sequences():
        for index, mb in stored_pass_batches(rollout, forward_batch_size, forward_batch_tokens):
            v = state_values(value_model, mb)
            after_last = v.gather(1, (last_response_index(mb.response_mask) + 1).unsqueeze(1)).squeeze(1)
            values.append((index, v[:, :-1]))
            bootstrap.append((index, torch.where(mb.terminated, 0.0, after_last)[:, None]))
        width = rollout.response_ids.shape[1]
        values, bootstrap = (
            scatter_rows(values, len(rollout), width),
            scatter_rows(bootstrap, len(rollout), 1),
        )
    return values.clone(), bootstrap.squeeze(1).clone()  # normal tensors, not inference ones


class PolicyAndValue(nn.Module):
    """The trained networks behind one ``forward``: the response tokens' log-probs and the policy's
    entropy (B, R) at the sampling temperature (:func:`response_logprobs`), and values (B, R) (None without
    a critic).

    One module so that data parallelism wraps one forward and one set of parameters: DDP then syncs the
    policy's and the critic's gradients in the same backward, and a shared trunk is synced once.
    """

    def __init__(self, policy: nn.Module, value_model: ValueModel | None) -> None:
        super().__init__()
        self.policy, self.value_model = policy, value_model
        self.checkpointed = checkpointed_layers(self)  # ppo.gradient_checkpointing: recomputed in backward

    def forward(self, batch: Rollout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        with checkpointing(self.checkpointed), whole_sequences():
            if self.value_model is None:
                return *response_logprobs(self.policy, batch), None
            if self.value_model.shared_trunk:
                return policy_logprobs_and_values(self.policy, self.value_model, batch)
            return *response_logprobs(self.policy, batch), state_values(self.value_model, batch)[:, :-1]


def scatter_rows(pieces: list[tuple[torch.Tensor, torch.Tensor]], batch: int, width: int) -> torch.Tensor:
    """(B, width) from ``(row indices, (b, w <= width))`` pieces; columns a trimmed piece lacks are 0."""
    first = pieces[0][1]
    out = first.new_zeros((batch, width))
    for index, piece in pieces:
        out[index.to(out.device), : piece.shape[1]] = piece
    return out
