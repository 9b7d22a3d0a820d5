"""Sequence rewards: a learned reward model, or a programmatic ``module:function``; optional transforms.

A reward model scores *text*: each (prompt, response text) is rendered with the reward model's own
tokenizer and chat template, never fed the policy's token ids (the two vocabularies need not agree).
The score is read at the last real token of that rendering, located with the tokenizer's attention
mask, not by searching for pad ids (which misfires when pad == EOS).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from lmppo.errors import LmppoError, user_code_error, warn
from lmppo.inputs.data import Prompt, as_messages, encode_chat, render_chat
from lmppo.math.core import masked_mean, masked_var
from lmppo.modeling.models import ValueModel, eval_mode
from lmppo.sampling.rollout import token_budget_groups
from lmppo.user_code import load_function


class RewardFunction(Protocol):
    """``(prompts, responses) -> (B,)`` float32 scores on the CPU, one per (prompt, response text)."""

    def __call__(self, prompts: Sequence[Prompt], responses: Sequence[str]) -> torch.Tensor: ...


# --------------------------------------------------------------------------------------------------
# Learned reward model
# --------------------------------------------------------------------------------------------------


def reward_model_messages(prompt: Prompt, response: str) -> list[dict[str, str]]:
    """The conversation a reward model scores: the prompt's turns, then the assistant's ``response``."""
    return [*as_messages(prompt), {"role": "assistant", "content": response}]


def render_for_reward_model(
    tokenizer: PreTrainedTokenizerBase, prompt: Prompt, response: str, chat_template: str | None = None
) -> str:
    """The text a reward model scores (what :meth:`RewardModelScorer.render` tokenises), for reading it.

    Reward-model training renders pairs through the same scorer, so scoring sees what training saw.
    """
    return render_chat(
        tokenizer, reward_model_messages(prompt, response), chat_template, add_generation_prompt=False
    )


class RewardModelScorer:
    """Scores (prompt, response text) pairs with a frozen reward model and its own tokenizer.

    ``chat_template`` overrides the tokenizer's; a tokenizer with neither is refused unless ``chats`` is
    off (a server that scores whole texts only, :meth:`render_query`). Renderings longer than
    ``max_length`` (default: the model's context window) keep their last tokens, where the score is read,
    with a warning.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        chat_template: str | None = None,
        chats: bool = True,
        max_length: int | None = None,
        batch_size: int = 16,
        batch_tokens: int | None = None,
    ) -> None:
        self.tokenizer, self.chat_template = tokenizer, chat_template
        if chats:
            self._check_template()
        self.token_scores = ValueModel.from_reward_model(
            model, copy_weights=False
        )  # per-token scores, a view
        self.max_length = max_length or getattr(model.config, "max_position_embeddings", None)
        self.batch_size, self.batch_tokens = batch_size, batch_tokens

    def _check_template(self) -> None:
        if self.chat_template is None and not self.tokenizer.chat_template:
            raise LmppoError(
                "the reward model's tokenizer has no chat template: set `reward.model.chat_template` (or "
                "`lmppo serve-rm --chat-template FILE`), or send it whole rendered texts (`query`)."
            )

    def render(self, prompt: Prompt, response: str) -> list[int]:
        """The conversation through the reward model's chat template; no text becomes a control token."""
        self._check_template()
        messages = reward_model_messages(prompt, response)
        return encode_chat(self.tokenizer, messages, self.chat_template, add_generation_prompt=False)

    def render_query(self, text: str) -> list[int]:
        """A whole text the client rendered itself (OpenRLHF's remote reward model request), rendered as
        OpenRLHF's server does: leading and trailing runs of EOS and pad tokens removed, one EOS appended,
        tokenised with the tokenizer's own special tokens. The text's control tokens are its client's."""
        eos, pad = self.tokenizer.eos_token, self.tokenizer.pad_token
        if eos is None:
            raise LmppoError("the reward model's tokenizer has no EOS token, which a `query` text ends with")
        ends = "|".join(re.escape(token) for token in {eos, pad} if token)
        return self.tokenizer(re.sub(f"^({ends})+|({ends})+$", "", text) + eos)["input_ids"]

    def __call__(self, prompts: Sequence[Prompt], responses: Sequence[str]) -> torch.Tensor:
        """(B,) float32 scores on the CPU."""
        return self.score_ids([self.render(p, r) for p, r in zip(prompts, responses, strict=True)])

    def score_ids(self, rows: list[list[int]]) -> torch.Tensor:
        """(B,) float32 scores of rendered rows on the CPU, in batches of rows or of a token budget."""
        too_long = sum(self.max_length is not None and len(ids) > self.max_length for ids in rows)
        if too_long:
            warn(f"{too_long} reward-model inputs exceed {self.max_length} tokens; keeping their last tokens")
            rows = [ids[-self.max_length :] for ids in rows]
        if not rows:
            return torch.zeros(0)
        if self.batch_tokens:  # by length within a budget; scores go back to their rows' places
            groups = token_budget_groups(self.batch_tokens, torch.tensor([len(ids) for ids in rows]))
        else:
            groups = [
                list(range(i, min(i + self.batch_size, len(rows))))
                for i in range(0, len(rows), self.batch_size)
            ]
        scores = torch.zeros(len(rows))
        for group in groups:
            scores[group] = self._score_batch([rows[i] for i in group])
        return scores

    def _score_batch(self, rows: list[list[int]]) -> torch.Tensor:
        device = next(self.token_scores.parameters()).device
        width = max(len(ids) for ids in rows)
        input_ids = torch.zeros(
            (len(rows), width), dtype=torch.long
        )  # right padding; the pad id is never read
        attention_mask = torch.zeros_like(input_ids)
        for i, ids in enumerate(rows):
            input_ids[i, : len(ids)] = torch.tensor(ids)
            attention_mask[i, : len(ids)] = 1
        position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
        last_real = attention_mask.sum(dim=1) - 1  # (b,)
        with torch.inference_mode(), eval_mode(self.token_scores):
            per_token = self.token_scores(
                input_ids.to(device), attention_mask.to(device), position_ids.to(device)
            )
            return per_token.gather(1, last_real.to(device).unsqueeze(1)).squeeze(1).cpu().clone()


# --------------------------------------------------------------------------------------------------
# Programmatic rewards
# --------------------------------------------------------------------------------------------------


class ProgrammaticReward:
    """A user function ``(prompts, responses) -> one float per row``, with its output's type and length
    checked (a non-finite score is refused by :meth:`CombinedReward.raw_scores`, as any source's)."""

    def __init__(self, function, name: str) -> None:
        self.function, self.name = function, name

    def __call__(self, prompts: Sequence[Prompt], responses: Sequence[str]) -> torch.Tensor:
        try:
            raw = self.function(list(prompts), list(responses))
        except Exception as err:  # the user's code: shown as theirs, with their frames
            raise user_code_error(f"reward function {self.name}", err) from None
        try:
            scores = torch.as_tensor(raw, dtype=torch.float32).cpu().reshape(-1)
        except (TypeError, ValueError, RuntimeError) as err:
            raise LmppoError(
                f"reward function {self.name} returned {type(raw).__name__}, not one float per row."
            ) from err
        if scores.numel() != len(responses):
            raise LmppoError(
                f"reward function {self.name} returned {scores.numel()} scores for {len(responses)} responses."
            )
        return scores


def no_reward(prompts: Sequence[Prompt], responses: Sequence[str]) -> torch.Tensor:
    """The final reward of a run with no reward source: 0 for every row (its environment's turn rewards are
    the whole reward)."""
    return torch.zeros(len(responses))


def load_reward_function(spec: str) -> ProgrammaticReward:
    """A programmatic reward from ``"package.module:function"`` or ``"path/to/file.py:function"``."""
    return ProgrammaticReward(load_function(spec, "reward function"), spec)


# --------------------------------------------------------------------------------------------------
# Score transforms
# --------------------------------------------------------------------------------------------------


class ScoreTransform:
    """Optional score preprocessing, applied in this order (each off by default):

    1. ``missing_eos_penalty``: subtract this from rows that did not emit a stop token (truncated).
    2. ``normalize``: standardise with the running mean / std of every score seen so far (this batch
       included; over all ranks when given a process group).
    3. ``clip``: clamp to ``[-clip, clip]`` (in normalised units when ``normalize`` is on).

    ``__call__`` returns the scores and a dict of what it did, for logging (empty when all are off).
    """

    def __init__(
        self, missing_eos_penalty: float | None = None, clip: float | None = None, normalize: bool = False
    ) -> None:
        if clip is not None and clip <= 0:
            raise LmppoError(f"score clip must be > 0, got {clip}.")
        self.missing_eos_penalty, self.clip, self.normalize = missing_eos_penalty, clip, normalize
        self.count, self.mean, self.var = 0.0, 0.0, 1.0

    def __call__(
        self, scores: torch.Tensor, terminated: torch.Tensor, group: dist.ProcessGroup | None = None
    ) -> tuple[torch.Tensor, dict[str, float]]:
        scores, info = scores.float(), {}
        if self.missing_eos_penalty is not None:
            penalised = ~terminated.to(scores.device)
            scores = scores - self.missing_eos_penalty * penalised.float()
            info["reward/eos_penalty_frac"] = float(penalised.float().mean())
        if self.normalize:
            self._update(scores, group)
            scores = (scores - self.mean) / math.sqrt(self.var + 1e-8)
            info["reward/norm_mean"], info["reward/norm_std"] = self.mean, math.sqrt(self.var)
        if self.clip is not None:
            info["reward/clip_frac"] = float((scores.abs() > self.clip).float().mean())
            scores = scores.clamp(-self.clip, self.clip)
        return scores, info

    def _update(self, scores: torch.Tensor, group: dist.ProcessGroup | None) -> None:
        """Merge this batch's (global) count, mean and variance into the running ones (Chan et al.)."""
        ones = torch.ones_like(scores)
        count = torch.tensor(float(scores.numel()), device=scores.device)
        if group is not None:
            dist.all_reduce(count, group=group)
        batch_mean = float(masked_mean(scores, ones, group))
        batch_var = float(masked_var(scores, ones, unbiased=False, group=group))
        n = float(count)
        total = self.count + n
        delta = batch_mean - self.mean
        self.var = (self.count * self.var + n * batch_var + delta**2 * self.count * n / total) / total
        self.mean += delta * n / total
        self.count = total

    def state_dict(self) -> dict[str, float]:
        return {"count": self.count, "mean": self.mean, "var": self.var}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.count, self.mean, self.var = float(state["count"]), float(state["mean"]), float(state["var"])


# --------------------------------------------------------------------------------------------------
# Several rewards at once
# --------------------------------------------------------------------------------------------------


@dataclass
class ScoredComponent:
    """One reward component: its scorer (raw scores), weight, preprocessing and, if learned, its model."""

    name: str
    score: RewardFunction
    weight: float = 1.0
    transform: ScoreTransform = field(default_factory=ScoreTransform)
    model: torch.nn.Module | None = None
    source: str = ""  # what the user named, for errors: "reward function f.py:score", "reward model DIR", ...

    def checked_scores(self, prompts: Sequence[Prompt], responses: Sequence[str]) -> torch.Tensor:
        """(B,) float32 raw scores; a non-finite one is the reward's fault and stops here, before any
        advantage, update or statistic is computed from it."""
        scores = self.score(prompts, responses).float()
        bad = (~torch.isfinite(scores)).nonzero().flatten().tolist()
        if bad:
            raise NonFiniteReward(self.source or f"reward {self.name}", scores, bad, prompts, responses)
        return scores


class NonFiniteReward(LmppoError):
    """A reward source scored some responses NaN or infinite: named with the rows, their prompts and texts."""

    def __init__(self, source: str, scores, bad: list[int], prompts, responses) -> None:
        shown = "; ".join(
            f"{scores[i].item()} for prompt {_clipped(prompts[i])} and response {_clipped(responses[i])}"
            for i in bad[:2]
        )
        super().__init__(
            f"{source} scored {len(bad)} of {len(responses)} responses with a non-finite value, e.g. {shown}. "
            "A reward must be a finite number for every response, or the advantages and the update turn to "
            "NaN: fix the reward (give a response it cannot judge a low finite score)"
        )


def _clipped(text, width: int = 40) -> str:
    """A prompt or response for an error message: repr'd, cut to ``width`` characters."""
    text = repr(text)
    return text if len(text) <= width else text[: width - 3] + "..."


class CombinedReward:
    """The run's reward: ``components`` scored in one sweep, each preprocessed by its own transform, and
    summed with their weights into the scalar on each response's last token.

    Called as a :class:`RewardFunction` (evaluation, the pre-flight) it returns the weighted sum of the
    *raw* scores, with no transform state touched. ``gate`` = (component, below): rows whose raw score of
    that component is below ``below`` take its preprocessed score alone (Llama 2's safety gate).
    ``named`` says whether the components have metrics of their own (``reward.components``), not only
    the shorthand's one source.
    """

    def __init__(
        self,
        components: Sequence[ScoredComponent],
        gate: tuple[str, float] | None = None,
        named: bool = False,
    ) -> None:
        self.components, self.gate, self.named = list(components), gate, named

    @property
    def models(self) -> list[torch.nn.Module]:
        """The learned components' frozen networks (sharded, gathered and counted like the reference)."""
        return [c.model for c in self.components if c.model is not None]

    def raw_scores(self, prompts: Sequence[Prompt], responses: Sequence[str]) -> dict[str, torch.Tensor]:
        """name -> (B,) float32 raw scores, each component on its own rendering of the texts."""
        return {c.name: c.checked_scores(prompts, responses) for c in self.components}

    def weighted(self, scores: dict[str, torch.Tensor]) -> torch.Tensor:
        """(B,) weighted sum of per-component scores."""
        return sum(c.weight * scores[c.name] for c in self.components)

    def __call__(self, prompts: Sequence[Prompt], responses: Sequence[str]) -> torch.Tensor:
        return self.weighted(self.raw_scores(prompts, responses))

    def shape(
        self, raw: dict[str, torch.Tensor], terminated: torch.Tensor, group: dist.ProcessGroup | None = None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, float]]:
        """The (B,) score the PPO reward uses; per-row ``reward/<name>/raw`` and ``/used`` (weight included)
        to average, when named; and each transform's statistics (under ``reward/<name>/`` when named)."""
        used, per_row, stats = {}, {}, {}
        for c in self.components:
            used[c.name], info = c.transform(raw[c.name].to(terminated.device), terminated, group)
            prefix = f"reward/{c.name}/" if self.named else "reward/"
            stats.update({prefix + key.removeprefix("reward/"): value for key, value in info.items()})
            if self.named:
                per_row[f"reward/{c.name}/raw"] = raw[c.name].to(terminated.device)
                per_row[f"reward/{c.name}/used"] = c.weight * used[c.name]
        score = self.weighted(used)
        if self.gate is not None:
            name, below = self.gate
            gated = raw[name].to(score.device) < below
            score = torch.where(gated, used[name], score)
            per_row["reward/gate_frac"] = gated.float()
        return score, per_row, stats

    def state_dict(self) -> dict[str, dict[str, float]]:
        return {c.name: c.transform.state_dict() for c in self.components}

    def load_state_dict(self, state: dict) -> None:
        if "count" in state:  # a one-source checkpoint of before reward components
            state = {self.components[0].name: state}
        for c in self.components:
            c.transform.load_state_dict(state[c.name])
