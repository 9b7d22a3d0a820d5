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

The environments of a batch reset together and those of a turn step together (:class:`EnvironmentCalls`,
at most ``rollout.environment_workers`` at once), and their answers are applied in episode order once all
have come: the episodes do not depend on which answered first. A call that runs past
``rollout.environment_timeout_s`` truncates its episode (``timeouts``) and the run goes on, unless more than
half of a turn's calls overran.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import math
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

import torch
from jinja2 import TemplateError

from lmppo.errors import LmppoError, user_code_error
from lmppo.inputs.data import ROLES, Prompt, as_messages
from lmppo.sampling.engines import Engine, OnEngine, sample_seed
from lmppo.sampling.environments import Environment, Step
from lmppo.sampling.prompts import PromptRenderer
from lmppo.sampling.rollout import EpisodePart, Rollout, response_mask_from_ids

MESSAGE_ROLES = (*ROLES, "tool")
# what each episode reports, in the metrics' order
COUNTS = ("turns", "tool_calls", "tool_failures", "timeouts")


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
        environment_workers: int = 32,
        environment_timeout_s: float = 120.0,
    ) -> None:
        self.engine, self.renderer = engine, renderer
        self.make_environment, self.name = make_environment, name
        self.max_turns, self.max_total_tokens, self.seed = max_turns, max_total_tokens, seed
        self.tokenizer = renderer.tokenizer
        self.calls = EnvironmentCalls(environment_workers, environment_timeout_s)
        self.environment_s = 0.0  # wall time waiting on the environments (concurrent calls counted once)

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
        episodes = self._start(prompts, rows, sample_ids)
        for turn in range(self.max_turns):
            live = [episode for episode in episodes if not episode.done]
            if not live:
                break
            self._play_turn(live, turn)
        self.engine.sleep()
        rollout = self._rollout(episodes, prompts, policy_version)
        generation_s = time.perf_counter() - started - self.environment_s
        return Rollout.after(rollout, generation_s=generation_s)

    def _start(
        self, prompts: Sequence[Prompt], rows: Sequence[dict[str, Any]], sample_ids: list[int]
    ) -> list[Episode]:
        """Each prompt's episode, its environment made and reset (the resets together). An episode whose reset
        overran plays no turn and holds one context token, the pad (a row needs a token): no action, so
        nothing of it reaches the loss, the KL or GAE, and its score, an empty answer's, reaches no token
        (a group estimator's baseline still counts it)."""
        episodes = [
            Episode(
                self._call("()", self.make_environment),
                self.renderer.query_ids(prompt, where=f"prompt of sample {sample_id}"),
                as_messages(prompt),
                sample_id,
            )
            for prompt, sample_id in zip(prompts, sample_ids, strict=True)
        ]
        resets = [
            (episode.environment.reset, (dict(row), sample_seed(self.seed, episode.sample_id)))
            for episode, row in zip(episodes, rows, strict=True)
        ]
        for episode, answer in zip(episodes, self._concurrently("reset", resets), strict=True):
            if answer.overran:
                episode.add([self.engine.pad_token_id], [0.0], context=True)
                self._overran(episode)
        return episodes

    def _play_turn(self, live: list[Episode], turn: int) -> None:
        """Every live episode's next turn, sampled together, then the environments' answers to it."""
        room = [self.max_total_tokens - len(episode.tokens) for episode in live]
        samples = self._sample_turns(
            [episode.query + episode.tokens for episode in live],
            [episode.sample_id for episode in live],
            turn,
            min(self.engine.settings.max_new_tokens, max(room)),
        )
        stopped = []  # (episode, the stop token that ended its turn)
        for episode, (tokens, logps), left in zip(live, samples, room, strict=True):
            tokens, logps = tokens[:left], logps[:left]
            episode.add(tokens, logps, context=False)
            episode.counts["turns"] += 1
            ended = tokens[-1] in self.engine.settings.stop_token_ids
            episode.last_turn = self.tokenizer.decode(
                tokens[:-1] if ended else tokens, skip_special_tokens=True
            )
            if ended:
                stopped.append((episode, tokens[-1]))
            else:  # cut at max_new_tokens or at the episode's budget
                episode.end(terminated=False)
        self._step(stopped, more_turns=turn + 1 < self.max_turns)

    def _step(self, stopped: list[tuple[Episode, int]], more_turns: bool) -> None:
        """The environments of the episodes that ended their turn (with that stop token), stepped together;
        their answers applied in episode order, whatever order they came in."""
        steps = self._concurrently(
            "step", [(episode.environment.step, (episode.last_turn,)) for episode, _ in stopped]
        )
        for (episode, stop_token), answer in zip(stopped, steps, strict=True):
            if answer.overran:
                self._overran(episode)
                continue
            step = self._checked(answer.value)
            try:
                self._answer(episode, step, stop_token, more_turns)
            except LmppoError as err:
                if isinstance(err.__context__, TemplateError) and any(
                    m["role"] == "tool" for m in step.messages
                ):
                    raise self._no_tool_role(err.__context__) from None
                raise

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

    def _answer(self, episode: Episode, step: Step, stop_token: int, more_turns: bool) -> None:
        """The environment's step on the episode's last turn: its reward, and the context it inserts."""
        episode.rewards[-1] += step.reward
        episode.counts["tool_calls"] += step.tool_calls
        episode.counts["tool_failures"] += step.tool_failures
        if step.done or not more_turns:  # not done after max_turns: truncated
            episode.end(terminated=step.done)
            return
        context = self.renderer.context_ids(
            episode.history, episode.last_turn, self.tokenizer.decode([stop_token]), step.messages
        )
        if len(episode.tokens) + len(context) >= self.max_total_tokens:  # no room for another turn
            episode.end(terminated=False)
            return
        episode.add(context, [0.0] * len(context), context=True)
        episode.history += [{"role": "assistant", "content": episode.last_turn}, *step.messages]

    def _concurrently(self, method: str, calls: list[tuple[Callable, tuple]]) -> list[Answer]:
        """The environments' ``method`` calls, run together (:class:`EnvironmentCalls`) and timed by the wall
        clock; what one raised is an error naming the environment (the first in episode order), and so is a
        turn where more than half of them overran."""
        started = time.perf_counter()
        try:
            answers = self.calls.run(calls) if calls else []
        finally:
            self.environment_s += time.perf_counter() - started
        for answer in answers:
            if answer.error is not None:
                raise self._named(method, answer.error) from None
        overran = sum(answer.overran for answer in answers)
        if 2 * overran > len(answers):
            raise LmppoError(
                f"rollout.environment {self.name}: {overran} of the {len(answers)} {method} calls of one "
                f"turn ran past rollout.environment_timeout_s ({self.calls.timeout_s:g} s), so the run stops "
                "(a few would only truncate their episodes, counted in episode/timeouts). Raise "
                "rollout.environment_timeout_s above the environment's slowest answer, or make it answer "
                "sooner (its tool's or server's latency)"
            )
        return answers

    def _call(self, method: str, function: Callable, *args):
        """The environment's code, timed; what it raises named as the environment's."""
        started = time.perf_counter()
        try:
            return function(*args)
        except Exception as err:
            raise self._named(method, err) from None
        finally:
            self.environment_s += time.perf_counter() - started

    def _named(self, method: str, err: BaseException) -> BaseException:
        """What the environment's ``method`` raised, as its error (an LmppoError as it is)."""
        if isinstance(err, LmppoError):
            return err
        return user_code_error(f"rollout.environment {self.name} ({method})", err)

    def _overran(self, episode: Episode) -> None:
        """An episode whose environment call overran: truncated, and its environment never called again."""
        episode.counts["timeouts"] += 1
        episode.end(terminated=False)

    def _no_tool_role(self, refusal: TemplateError) -> LmppoError:
        return LmppoError(
            f"rollout.environment {self.name} answered with messages of role 'tool', and the policy's chat "
            f'template refused them ({refusal}): it has no tool role. Set result_role = "user" on the '
            "ToolEnvironment subclass (lmppo.sampling.environments.ToolEnvironment.result_role) so that tool "
            "results come as user messages (another environment: answer with role 'user'), or give the "
            "policy a template with a tool role (models.policy.chat_template)"
        )

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

    def close(self, abandon: bool = False) -> None:
        self.calls.close()
        super().close(abandon)

    def _transcript(self, episode: Episode) -> list[tuple[str, bool]]:
        """The episode after its prompt as runs of text, each the policy's (True) or context (False), control
        tokens shown: what the report prints with the two told apart."""
        runs = []
        for is_context, group in itertools.groupby(zip(episode.tokens, episode.context), key=lambda t: t[1]):
            ids = [token for token, _ in group]
            runs.append((self.tokenizer.decode(ids, skip_special_tokens=False), not is_context))
        return runs


@dataclass(frozen=True)
class Answer:
    """How one environment call ended: what it returned or raised, or that it overran (and was abandoned)."""

    value: Any = None
    error: BaseException | None = None
    overran: bool = False


class EnvironmentCalls:
    """Environment calls run together, each within ``timeout_s`` of its start, at most ``workers`` at once:
    coroutine functions (an async environment's ``reset`` and ``step``) as tasks of one event loop, plain
    ones each on a thread of its own that the loop awaits. The loop runs on a daemon thread, made on first
    use and stopped by :meth:`close`; async environments keep it for their whole life (a client bound to it
    stays usable). A call that overruns is abandoned: its task cancelled and never awaited, its thread never
    joined. The threads are daemons, not a pool's workers, which the interpreter joins at exit: a hung call
    holds up neither a turn nor the process's end. An async environment must not block the loop
    (``time.sleep``, a synchronous request): every call waits for it then, and no timeout fires."""

    def __init__(self, workers: int, timeout_s: float) -> None:
        self.workers, self.timeout_s = workers, timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None

    def run(self, calls: list[tuple[Callable, tuple]]) -> list[Answer]:
        """Each ``function(*args)`` of ``calls``, together; their answers in the calls' order."""
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            threading.Thread(
                target=_serve, args=(self._loop,), name="lmppo environments", daemon=True
            ).start()
        return asyncio.run_coroutine_threadsafe(self._all(calls), self._loop).result()

    def close(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop = None

    async def _all(self, calls: list[tuple[Callable, tuple]]) -> list[Answer]:
        gate = asyncio.Semaphore(self.workers)  # first come, first served: one worker calls in order
        return await asyncio.gather(*(self._one(gate, function, args) for function, args in calls))

    async def _one(self, gate: asyncio.Semaphore, function: Callable, args: tuple) -> Answer:
        async with gate:  # the time limit runs from the call's start, not from its wait for a worker
            if inspect.iscoroutinefunction(function):
                running = asyncio.ensure_future(function(*args))
            else:
                running = _on_thread(function, args)
            done, _ = await asyncio.wait({running}, timeout=self.timeout_s)
        if not done:
            running.cancel()
            return Answer(overran=True)
        if running.exception() is not None:
            return Answer(error=running.exception())
        return Answer(value=running.result())


def _serve(loop: asyncio.AbstractEventLoop) -> None:
    asyncio.set_event_loop(loop)
    loop.run_forever()
    loop.close()


def _on_thread(function: Callable, args: tuple) -> asyncio.Future:
    """``function(*args)`` on a daemon thread of its own, as a future of the running loop."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(value: Any, error: BaseException | None) -> None:
        if future.cancelled():  # overran: the answer goes nowhere
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)

    def call() -> None:
        value, error = None, None
        try:
            value = function(*args)
        except Exception as err:
            error = err
        with suppress(RuntimeError):  # the loop was closed meanwhile (the generator was)
            loop.call_soon_threadsafe(settle, value, error)

    threading.Thread(target=call, name="lmppo environment call", daemon=True).start()
    return future


def _is_message(message: object) -> bool:
    return (
        isinstance(message, dict)
        and isinstance(message.get("content"), str)
        and message.get("role") in MESSAGE_ROLES
    )
