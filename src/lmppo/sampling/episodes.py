"""Multi-turn episodes: the policy and an environment take turns until the environment says done
(``rollout.environment``; the environments are :mod:`lmppo.sampling.environments`, the guide
docs/multiturn.md).

All live episodes sample their next turn together, then each environment steps on its episode's turn;
episodes that end drop out of generation. The trajectory is built token by token and nothing is
re-tokenised: the policy's turns are the tokens it sampled (stop token included) with the log-probs it drew
them at, the **actions**; what the chat template and the environment add between turns is rendered as the
difference between the conversation with and without it (:func:`lmppo.inputs.data.encode_context`), the
**context**: in the sequence the critic and the policy read, never in the loss, the KL or GAE's credit path.

An episode ends **terminated** when the environment says done, and **truncated** when a turn runs into
``rollout.max_new_tokens`` or the episode into ``rollout.max_total_tokens``, or after ``rollout.max_turns``
turns; a truncated episode is scored or bootstrapped as ``rollout.truncation`` says, like a cut response.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lmppo.errors import LmppoError, user_code_error
from lmppo.inputs.data import ROLES, Prompt, as_messages, encode_context
from lmppo.sampling.engines import Engine, OnEngine, sample_seed
from lmppo.sampling.environments import Environment, Step
from lmppo.sampling.prompts import PromptRenderer
from lmppo.sampling.rollout import EpisodePart, Rollout, response_mask_from_ids

MESSAGE_ROLES = (*ROLES, "tool")
COUNTS = ("turns", "tool_calls", "tool_failures")  # what each episode reports, in the metrics' order


@dataclass
class Episode:
    """One episode as it is played: the environment, the tokens after the prompt and what each one is."""

    environment: Environment
    query: list[int]  # the rendered prompt
    history: list[dict[str, str]]  # the conversation so far, as messages
    sample_id: int
    tokens: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)  # 0 on context tokens (never read)
    context: list[bool] = field(default_factory=list)  # True: inserted by the template or the environment
    rewards: list[float] = field(default_factory=list)  # each turn's reward on its last action
    counts: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(COUNTS, 0)
    )  # logged as episode/<name>
    last_turn: str = ""  # the policy's last message: what the run's reward scores
    done: bool = False
    terminated: bool = False

    def add(self, tokens: list[int], logps: list[float], context: bool) -> None:
        self.tokens += tokens
        self.logps += logps
        self.context += [context] * len(tokens)
        self.rewards += [0.0] * len(tokens)

    def end(self, terminated: bool) -> None:
        self.done, self.terminated = True, terminated


class EpisodeGenerator(OnEngine):
    """A :class:`lmppo.sampling.engines.Generator` that plays episodes on any engine: ``engine`` (the decode
    loop, its snapshot under ``rollout.asynchronous``, or vLLM) samples each turn, one ``make_environment()``
    per episode answers it, ``renderer`` renders the prompts."""

    def __init__(
        self,
        engine: Engine,
        renderer: PromptRenderer,
        make_environment: Callable[[], Environment],
        *,
        name: str,
        max_turns: int,
        max_total_tokens: int,
        seed: int,
    ) -> None:
        self.engine, self.renderer = engine, renderer
        self.make_environment, self.name = make_environment, name
        self.max_turns, self.max_total_tokens, self.seed = max_turns, max_total_tokens, seed
        self.tokenizer = renderer.tokenizer
        self.environment_s = 0.0

    def generate(
        self,
        prompts: Sequence[Prompt],
        policy_version: int,
        sample_ids: Sequence[int] | None = None,
        rows: Sequence[dict[str, Any]] | None = None,
    ) -> Rollout:
        """Play one episode per prompt (its row, when given, is what the environment resets on)."""
        started, self.environment_s = time.perf_counter(), 0.0
        sample_ids = list(range(len(prompts))) if sample_ids is None else list(sample_ids)
        rows = [{"prompt": prompt} for prompt in prompts] if rows is None else rows
        episodes = [self._start(*args) for args in zip(prompts, rows, sample_ids, strict=True)]
        for turn in range(self.max_turns):
            live = [episode for episode in episodes if not episode.done]
            if not live:
                break
            self._play_turn(live, turn)
        self.engine.sleep()
        rollout = self._rollout(episodes, prompts, policy_version)
        generation_s = time.perf_counter() - started - self.environment_s
        return Rollout.after(rollout, generation_s=generation_s)

    def _start(self, prompt: Prompt, row: dict[str, Any], sample_id: int) -> Episode:
        environment = self._call("()", self.make_environment)
        self._call("reset", environment.reset, dict(row), sample_seed(self.seed, sample_id))
        query = self.renderer.query_ids(prompt, where=f"prompt of sample {sample_id}")
        return Episode(environment, query, as_messages(prompt), sample_id)

    def _play_turn(self, live: list[Episode], turn: int) -> None:
        """Every live episode's next turn, sampled together, then each environment's answer."""
        room = [self.max_total_tokens - len(episode.tokens) for episode in live]
        samples = self._sample_turns(
            [episode.query + episode.tokens for episode in live],
            [episode.sample_id for episode in live],
            turn,
            min(self.engine.settings.max_new_tokens, max(room)),
        )
        for episode, (tokens, logps), left in zip(live, samples, room, strict=True):
            tokens, logps = tokens[:left], logps[:left]
            episode.add(tokens, logps, context=False)
            episode.counts["turns"] += 1
            stopped = tokens[-1] in self.engine.settings.stop_token_ids
            episode.last_turn = self.tokenizer.decode(
                tokens[:-1] if stopped else tokens, skip_special_tokens=True
            )
            if not stopped:  # cut at max_new_tokens or at the episode's budget
                episode.end(terminated=False)
                continue
            self._answer(episode, tokens[-1], more_turns=turn + 1 < self.max_turns)

    def _sample_turns(
        self, contexts: list[list[int]], sample_ids: list[int], turn: int, max_new_tokens: int
    ) -> list[tuple[list[int], list[float]]]:
        """One turn of each live episode, sampled after ``contexts`` (the token ids of each episode so far):
        each row's tokens up to and including its stop token (all of them when it was cut) and their
        log-probs at the sampling temperature."""
        engine = self.engine
        query_ids, query_mask = (t.to(engine.device) for t in self.renderer.left_padded(contexts))
        response_ids, logp_old, _ = engine.sample(query_ids, query_mask, sample_ids, max_new_tokens, turn)
        response_mask, _ = response_mask_from_ids(response_ids, engine.settings.stop_token_ids)
        lengths = response_mask.sum(dim=1).long().tolist()
        return [
            (ids[:n].tolist(), logp[:n].tolist()) for ids, logp, n in zip(response_ids, logp_old, lengths)
        ]

    def _answer(self, episode: Episode, stop_token: int, more_turns: bool) -> None:
        """The environment's step on the episode's last turn: its reward, and the context it inserts."""
        step = self._checked(self._call("step", episode.environment.step, episode.last_turn))
        episode.rewards[-1] += step.reward
        episode.counts["tool_calls"] += step.tool_calls
        episode.counts["tool_failures"] += step.tool_failures
        if step.done or not more_turns:  # not done after max_turns: truncated
            episode.end(terminated=step.done)
            return
        context = encode_context(
            self.tokenizer,
            self.renderer.chat_template,
            episode.history,
            episode.last_turn,
            self.tokenizer.decode([stop_token]),
            step.messages,
            more_turns=True,
        )
        if len(episode.tokens) + len(context) >= self.max_total_tokens:  # no room for another turn
            episode.end(terminated=False)
            return
        episode.add(context, [0.0] * len(context), context=True)
        episode.history += [{"role": "assistant", "content": episode.last_turn}, *step.messages]

    def _call(self, method: str, function: Callable, *args):
        """The environment's code, timed; what it raises named as the environment's."""
        started = time.perf_counter()
        try:
            return function(*args)
        except LmppoError:
            raise
        except Exception as err:
            raise user_code_error(f"rollout.environment {self.name} ({method})", err) from None
        finally:
            self.environment_s += time.perf_counter() - started

    def _checked(self, step: object) -> Step:
        """A step as :class:`Step` says, or an error naming the environment and what it returned."""
        if not isinstance(step, Step):
            problem = f"returned {type(step).__name__}, not a lmppo.sampling.environments.Step"
        elif not isinstance(step.messages, list) or not all(_is_message(m) for m in step.messages):
            problem = (
                f"returned the messages {step.messages!r:.200}; each must be {{'role', 'content'}} with string "
                f"content and a role in {list(MESSAGE_ROLES)}"
            )
        elif not isinstance(step.reward, int | float) or not math.isfinite(step.reward):
            problem = f"returned the reward {step.reward!r}; a turn's reward is a finite number"
        else:
            return step
        raise LmppoError(f"rollout.environment {self.name}: step {problem}")

    def _rollout(self, episodes: list[Episode], prompts: Sequence[Prompt], policy_version: int) -> Rollout:
        """The episodes as one :class:`Rollout`: the response is everything after the prompt."""
        query_ids, query_mask = self.renderer.left_padded([episode.query for episode in episodes])
        width = max(len(episode.tokens) for episode in episodes)
        shape = (len(episodes), width)
        response_ids = torch.full(shape, self.engine.pad_token_id, dtype=torch.long)
        response_mask, context_mask = torch.zeros(shape), torch.zeros(shape)
        logp_old, turn_rewards = torch.zeros(shape), torch.zeros(shape)
        for i, episode in enumerate(episodes):
            n = len(episode.tokens)
            response_ids[i, :n] = torch.tensor(episode.tokens)
            response_mask[i, :n] = 1.0
            context_mask[i, :n] = torch.tensor(episode.context, dtype=torch.float32)
            logp_old[i, :n] = torch.tensor(episode.logps)
            turn_rewards[i, :n] = torch.tensor(episode.rewards)
        device = self.engine.device
        counts = {name: torch.tensor([e.counts[name] for e in episodes], device=device) for name in COUNTS}
        return Rollout(
            query_ids=query_ids.to(device),
            query_mask=query_mask.to(device),
            response_ids=response_ids.to(device),
            response_mask=response_mask.to(device),
            terminated=torch.tensor([episode.terminated for episode in episodes], device=device),
            logp_old=logp_old.to(device),
            policy_version=self.engine.version_sampled(policy_version),
            created_at=time.time(),
            prompts=list(prompts),
            response_texts=[episode.last_turn for episode in episodes],
            temperature=self.engine.settings.temperature,
            episode=EpisodePart(
                context_mask=context_mask.to(device),
                turn_rewards=turn_rewards.to(device),
                transcripts=[self._transcript(episode) for episode in episodes],
                counts=counts,
                environment_s=self.environment_s,
            ),
        )

    def _transcript(self, episode: Episode) -> list[tuple[str, bool]]:
        """The episode after its prompt as runs of text, each the policy's (True) or context (False), control
        tokens shown: what the report prints with the two told apart."""
        runs = []
        for is_context, group in itertools.groupby(zip(episode.tokens, episode.context), key=lambda t: t[1]):
            ids = [token for token, _ in group]
            runs.append((self.tokenizer.decode(ids, skip_special_tokens=False), not is_context))
        return runs


def _is_message(message: object) -> bool:
    return (
        isinstance(message, dict)
        and isinstance(message.get("content"), str)
        and message.get("role") in MESSAGE_ROLES
    )
