"""Multi-turn episodes (lmppo.sampling.episodes): the action/context record of a hand-built episode, the
PPO contract over actions only, environments that break, and a PPO run that trains on one."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch
import yaml
from helpers import PROMPTS, ROLE_TEMPLATE, boost_token, role_tokenizer, run_cli, toy_models, toy_trainer
from sample_environments import (
    RELEASE,
    AnswerTwice,
    AsyncHangsOnPoems,
    AsyncJittery,
    HangsOnPoems,
    Jittery,
    Sleeps,
)

from lmppo.errors import LmppoError
from lmppo.inputs.data import encode_chat, encode_context
from lmppo.math import core
from lmppo.math.core import token_logprobs
from lmppo.sampling.environments import Step
from lmppo.sampling.episodes import EpisodeGenerator
from lmppo.sampling.hf_engine import hf_generator
from lmppo.sampling.passes import response_logits
from lmppo.toy import tools
from lmppo.toy.models import build_policy
from lmppo.toy.tokenizer import policy_template, tools_tokenizer
from lmppo.training.advantages import advantages_of


class Scripted:
    """Turn 1: a tool's answer; turn 2: the user's next message; turn 3: done, with a reward of 1."""

    answers = (
        Step(messages=[{"role": "tool", "content": "sun dog"}], reward=0.25, tool_calls=1),
        Step(messages=[{"role": "user", "content": "two"}]),
        Step(reward=1.0, done=True),
    )

    def reset(self, row, seed):
        self.row, self.seed, self.turn = row, seed, 0

    def step(self, text):
        self.turn += 1
        return self.answers[self.turn - 1]


def episodes(
    environment,
    *,
    model=None,
    max_turns=4,
    max_total_tokens=64,
    max_new_tokens=4,
    chat_template=None,
    **options,
):
    """An episode engine on a tiny Llama; by default one that always ends its turn at once (EOS). ``options``:
    the environments' workers and timeout."""
    tok = role_tokenizer()
    if chat_template is not None:
        tok.chat_template = chat_template
    if model is None:
        torch.manual_seed(0)
        model = toy_models().policy
        model.resize_token_embeddings(len(tok))
        boost_token(model, tok.eos_token_id, 12.0)
    generator = hf_generator(model, tok, max_new_tokens=max_new_tokens, seed=3)  # as a run samples
    return EpisodeGenerator(
        generator.engine,
        generator.renderer,
        environment,
        name="tests:Env",
        max_turns=max_turns,
        max_total_tokens=max_total_tokens,
        seed=3,
        **options,
    )


def test_an_episode_holds_the_sampled_actions_and_the_context_between_them():
    generator = episodes(Scripted)
    rollout = generator.generate(["tell me a story"], policy_version=0, sample_ids=[7])
    tok = generator.tokenizer
    ids = rollout.response_ids[0][rollout.response_mask[0].bool()].tolist()
    # every turn of the policy is its stop token alone (EOS boosted); the context is the template's and the
    # environment's text between the turns, the next generation prompt included
    words = tok.convert_ids_to_tokens(ids)
    assert words == [
        "</s>", "<|tool|>", "sun", "dog", "</s>", "<|assistant|>",
        "</s>", "<|user|>", "two", "</s>", "<|assistant|>", "</s>",
    ]  # fmt: skip
    actions = [0, 6, 11]
    assert rollout.action_mask[0].nonzero().flatten().tolist() == actions
    assert rollout.episode.context_mask[0][rollout.response_mask[0].bool()].nonzero().flatten().tolist() == [
        i for i in range(12) if i not in actions
    ]
    # each turn's stop token in the loss with its sampling log-prob; context log-probs never read (0)
    assert torch.all(rollout.logp_old[0, actions] < 0) and torch.all(
        rollout.logp_old[0, [1, 2, 3, 4, 5]] == 0
    )
    assert rollout.episode.turn_rewards[0, 0] == 0.25 and rollout.episode.turn_rewards[0, 11] == 1.0
    assert rollout.episode.turn_rewards[0].sum() == 1.25
    assert (
        bool(rollout.terminated[0])
        and rollout.episode.counts["turns"].tolist() == [3]
        and rollout.episode.counts["tool_calls"].tolist() == [1]
    )
    # never re-tokenised: prompt + episode is exactly the whole conversation as the template renders it
    conversation = [
        {"role": "user", "content": "tell me a story"},
        {"role": "assistant", "content": ""},
        {"role": "tool", "content": "sun dog"},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "two"},
        {"role": "assistant", "content": ""},
    ]
    query = rollout.query_ids[0][rollout.query_mask[0].bool()].tolist()
    assert query + ids == encode_chat(tok, conversation, None, add_generation_prompt=False)


def test_each_action_keeps_the_log_prob_it_was_sampled_at_in_the_whole_sequence():
    """A teacher-forced pass over prompt + episode gives, at every action, the log-prob the decode loop drew
    the token at: the context between turns shifts nothing (positions, attention)."""
    policy = toy_models().policy
    boost_token(policy, role_tokenizer().eos_token_id, 3.0)  # short turns: episodes with several of them
    torch.manual_seed(1)
    rollout = episodes(AnswerTwice, model=policy, max_new_tokens=6).generate(PROMPTS * 2, 0)
    assert (rollout.episode.counts["turns"] > 1).any() and rollout.episode.context_mask.sum() > 0
    actions = rollout.action_mask.bool()
    with torch.no_grad():
        forced = token_logprobs(response_logits(policy, rollout), rollout.response_ids)
    assert (forced - rollout.logp_old)[actions].abs().max() < 1e-5


def test_the_context_never_reaches_the_loss_the_kl_or_the_credit_path():
    """Whatever the reference's log-probs and the critic's values are at context positions, the KL-shaped
    rewards, advantages and returns at the actions are the same, and zero at the context."""
    from lmppo.sampling.rollout import ScoredRollout

    trainer = toy_trainer()
    rollout = episodes(Scripted).generate(["tell me a story", "write a poem"], 0)
    context = rollout.episode.context_mask.bool()
    gen = torch.Generator().manual_seed(0)

    def scored(noise: float) -> ScoredRollout:
        logp_ref = torch.randn(rollout.response_ids.shape, generator=gen) * noise
        values = torch.randn(rollout.response_ids.shape, generator=gen) * noise
        base = torch.full(rollout.response_ids.shape, -1.0)
        logp_ref = torch.where(context, logp_ref, base)
        kl_ref = core.kl_estimate(rollout.logp_old, logp_ref)  # stored as scoring does: on the actions only
        return ScoredRollout.after(
            rollout,
            rm_score=torch.tensor([0.5, -0.5]),
            logp_ref=logp_ref,
            kl_ref=torch.where(rollout.action_mask.bool(), kl_ref, 0.0),
            values=torch.where(context, values, base * 0.1),
            bootstrap_value=torch.zeros(2),
        )

    first, first_rewards = advantages_of(scored(1.0), 0.1, trainer.spec.estimator)
    second, second_rewards = advantages_of(scored(100.0), 0.1, trainer.spec.estimator)
    assert torch.equal(first_rewards.rewards, second_rewards.rewards)
    assert torch.equal(first.advantages, second.advantages) and torch.equal(first.returns, second.returns)
    assert torch.all(first.advantages[context] == 0) and torch.all(first_rewards.rewards[context] == 0)
    # credit crosses the tool's turn: the first action's advantage depends on the last turn's reward
    assert first.advantages[0, 0] != 0


class Raises:
    def reset(self, row, seed):
        pass

    def step(self, text):
        raise KeyError("no such tool table")


class AsyncRaises(Raises):
    async def step(self, text):
        raise KeyError("no such tool table")


class Garbage(Raises):
    def step(self, text):
        return {"messages": [], "done": True}


class NeverEnds(Raises):
    def step(self, text):
        return Step(messages=[{"role": "user", "content": "again"}])


def test_a_broken_environment_stops_with_a_message_naming_it():
    with pytest.raises(LmppoError, match=r"rollout.environment tests:Env \(step\) raised KeyError"):
        episodes(Raises).generate(["tell me"], 0)
    with pytest.raises(LmppoError, match=r"rollout.environment tests:Env \(step\) raised KeyError"):
        episodes(AsyncRaises).generate(["tell me"], 0)
    with pytest.raises(LmppoError, match=r"rollout.environment tests:Env: step returned dict, not a"):
        episodes(Garbage).generate(["tell me"], 0)


def test_max_turns_always_bounds_an_episode_and_truncates_it():
    rollout = episodes(NeverEnds, max_turns=3).generate(["tell me", "write"], 0)
    assert rollout.episode.counts["turns"].tolist() == [3, 3] and not rollout.terminated.any()
    # the last action ends the sequence: nothing inserted after it
    last = rollout.response_mask.sum(1).long() - 1
    assert torch.all(rollout.action_mask[torch.arange(2), last] == 1)


def test_max_total_tokens_bounds_actions_and_context_together():
    rollout = episodes(NeverEnds, max_turns=50, max_total_tokens=9).generate(["tell me"], 0)
    assert int(rollout.response_mask.sum()) <= 9 and not rollout.terminated.any()


def test_a_template_that_rewrites_earlier_turns_cannot_hold_an_episode():
    tok = role_tokenizer()
    dated = "{{ 'turns: ' ~ messages|length }} " + ROLE_TEMPLATE  # the header changes with every turn
    with pytest.raises(LmppoError, match="does not extend a conversation by appending an assistant turn"):
        encode_context(tok, dated, [{"role": "user", "content": "hi"}], "a", "</s>", [], more_turns=True)
    no_eos = ROLE_TEMPLATE.replace("{{ eos_token }}", "")
    with pytest.raises(LmppoError, match="without the stop token '</s>'"):
        encode_context(tok, no_eos, [{"role": "user", "content": "hi"}], "a", "</s>", [], more_turns=True)


def same_episodes(first, second) -> None:
    """Two rollouts hold the same episodes: tokens, log-probs, masks, turn rewards, counts and ends."""
    for name in ("query_ids", "response_ids", "response_mask", "logp_old", "terminated"):
        assert torch.equal(getattr(first, name), getattr(second, name)), name
    assert torch.equal(first.episode.context_mask, second.episode.context_mask)
    assert torch.equal(first.episode.turn_rewards, second.episode.turn_rewards)
    assert {k: v.tolist() for k, v in first.episode.counts.items()} == {
        k: v.tolist() for k, v in second.episode.counts.items()
    }
    assert first.response_texts == second.response_texts
    assert first.episode.transcripts == second.episode.transcripts


def test_environments_called_together_give_the_serial_run_s_episodes():
    """Calls that finish in a random order (their latency drawn from the system's entropy, not the seed),
    plain ones on threads and async ones on the event loop: the answers are applied in episode order, so a
    concurrent run holds exactly the episodes of a serial one."""
    policy = toy_models().policy
    boost_token(policy, role_tokenizer().eos_token_id, 3.0)  # short turns: episodes with several of them

    def play(environment, **options):
        return episodes(environment, model=policy, max_new_tokens=6, **options).generate(PROMPTS * 3, 0)

    serial = play(Jittery, environment_workers=1)
    assert (serial.episode.counts["turns"] > 1).any() and serial.episode.context_mask.sum() > 0
    for environment in (Jittery, AsyncJittery, Jittery, AsyncJittery):
        same_episodes(serial, play(environment))


def test_the_wait_on_the_environments_is_the_wall_time_of_each_turn_s_calls():
    """8 episodes x 2 steps of 0.1 s: 1.6 s one after another, 0.2 s all together, 0.4 s four at a time."""
    serial = episodes(Sleeps, environment_workers=1).generate(PROMPTS * 2, 0)
    assert serial.episode.environment_s >= 1.6
    together = episodes(Sleeps).generate(PROMPTS * 2, 0)
    assert together.episode.environment_s < 0.8
    assert episodes(Sleeps, environment_workers=4).generate(PROMPTS * 2, 0).episode.environment_s >= 0.4
    same_episodes(serial, together)


@pytest.fixture
def hanging():
    """Calls of :class:`HangsOnPoems` hang during the test; released after it (they return to no one)."""
    RELEASE.clear()
    yield
    RELEASE.set()


@pytest.mark.parametrize("environment", [HangsOnPoems, AsyncHangsOnPoems])
def test_a_step_past_the_timeout_truncates_its_episode_and_the_run_goes_on(hanging, environment):
    generator = episodes(environment, environment_timeout_s=0.3)
    started = time.perf_counter()
    rollout = generator.generate(PROMPTS, 0)  # the poem's first step hangs
    assert time.perf_counter() - started < 10  # the hung call is abandoned, never waited for
    poem = PROMPTS.index("write a short poem")
    counts = rollout.episode.counts
    assert counts["timeouts"].tolist() == [int(i == poem) for i in range(4)]
    assert counts["turns"].tolist() == [1 if i == poem else 2 for i in range(4)]
    assert rollout.terminated.tolist() == [i != poem for i in range(4)]
    # the poem's one turn is its action alone: no reward, no context, nothing after it
    assert rollout.episode.turn_rewards[poem].sum() == 0 and rollout.episode.context_mask[poem].sum() == 0
    assert 0.3 <= rollout.episode.environment_s < 3
    rollout = generator.generate(PROMPTS, 0)  # again: the hung call holds no worker back
    assert rollout.episode.counts["timeouts"].tolist() == [int(i == poem) for i in range(4)]
    assert HangsOnPoems.calls_after_hanging == 0  # an environment that overran is never called again
    if environment is HangsOnPoems:
        assert any(t.name == "lmppo environment call" and t.is_alive() for t in threading.enumerate())
    generator.close()


def test_an_episode_whose_reset_overran_plays_no_turn_and_holds_only_the_pad_as_context(hanging):
    prompts = ["tell me about the cat", "tell me a story", "the day was very happy", "the night was sad"]
    generator = episodes(HangsOnPoems, environment_timeout_s=0.3)
    rollout = generator.generate(prompts, 0)  # the night's reset hangs
    night, counts = 3, rollout.episode.counts
    assert counts["timeouts"].tolist() == [0, 0, 0, 1] and counts["turns"].tolist() == [2, 2, 2, 0]
    assert rollout.response_mask[night].sum() == 1 and rollout.action_mask[night].sum() == 0
    assert rollout.response_ids[night, 0] == generator.engine.pad_token_id and not rollout.terminated[night]
    assert rollout.response_texts[night] == "" and rollout.action_mask[:night].sum() > 0
    # no action: its score lands on no token (the loss, the KL and GAE read the actions only)
    shaped = core.shaped_rewards(
        torch.ones(4), torch.zeros(rollout.response_ids.shape), rollout.action_mask, 0.1
    )
    assert shaped[night].abs().sum() == 0 and torch.all(shaped[:night].sum(1) == 1)


def test_a_turn_where_more_than_half_the_calls_overran_stops_the_run(hanging):
    generator = episodes(HangsOnPoems, environment_timeout_s=0.3)
    half = generator.generate(["write a short poem", "a poem", "tell me", "tell me a story"], 0)
    assert half.episode.counts["timeouts"].tolist() == [1, 1, 0, 0]  # half: the run goes on
    with pytest.raises(
        LmppoError,
        match=r"rollout.environment tests:Env: 2 of the 3 step calls of one turn ran past "
        r"rollout.environment_timeout_s \(0.3 s\), so the run stops",
    ):
        generator.generate(["write a short poem", "a poem", "tell me"], 0)


def test_a_tool_answer_on_a_template_without_a_tool_role_names_the_environment_and_the_fix():
    """The toy policy template has no tool role: it raises on one, and the error says whose message it was
    and how to send tool results as user messages."""
    with pytest.raises(LmppoError) as caught:
        episodes(Scripted, chat_template=policy_template()).generate(["tell me a story"], 0)
    message = str(caught.value)
    assert message.startswith("rollout.environment tests:Env answered with messages of role 'tool'")
    assert "unknown chat role: tool" in message
    assert (
        'result_role = "user"' in message
        and "lmppo.sampling.environments.ToolEnvironment.result_role" in message
    )


def test_the_toy_tools_world_plays_the_same_episodes_serial_and_concurrent():
    """The calculator of ``lmppo quickstart --task tools`` with the tools world's policy leaning to calls:
    a concurrent run is bit for bit the serial one (so are the quickstart's metrics)."""
    tokenizer = tools_tokenizer(tools.tools_corpus(0))
    policy = build_policy(tokenizer, seed=0)
    boost_token(policy, tokenizer.convert_tokens_to_ids("<tool_call>"), 4.0)
    policy.lm_head.bias.data[tokenizer.eos_token_id] = 3.0
    rows = tools.prompts(8, seed=0, split="train")

    def play(**options):
        generator = hf_generator(policy, tokenizer, max_new_tokens=12, seed=0)
        episodes = EpisodeGenerator(
            generator.engine,
            generator.renderer,
            tools.Calculator,
            name="lmppo.toy.tools:Calculator",
            max_turns=4,
            max_total_tokens=96,
            seed=0,
            **options,
        )
        return episodes.generate([row["prompt"] for row in rows], 0, rows=rows)

    serial = play(environment_workers=1)
    assert serial.episode.counts["tool_calls"].sum() > 0 and (serial.episode.counts["turns"] > 1).any()
    same_episodes(serial, play())


ENVIRONMENT_FILE = '''
from lmppo.sampling.environments import Step


class TwoTurns:
    """Answers the first turn with the word the row asks for, then ends the episode."""

    def reset(self, row, seed):
        self.word, self.turn = row["word"], 0

    def step(self, text):
        self.turn += 1
        if self.turn == 1:
            return Step(messages=[{"role": "user", "content": self.word}], reward=0.1)
        return Step(done=True)
'''


@pytest.mark.slow
def test_lmppo_ppo_trains_on_an_environment_file(run_files, tmp_path):
    env_file = tmp_path / "env.py"
    env_file.write_text(ENVIRONMENT_FILE)
    rows = [{"prompt": prompt, "word": "good"} for prompt in PROMPTS * 2]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = yaml.safe_load(run_files.read_text())
    # a near-uniform policy: long turns, so that some end with EOS and the environment answers
    config["rollout"] |= {
        "environment": f"{env_file}:TwoTurns",
        "max_turns": 3,
        "max_new_tokens": 48,
        "max_total_tokens": 100,  # within the toy policy's 128 positions, with the prompt
    }
    run_files.write_text(yaml.safe_dump(config))
    assert run_cli("ppo", str(run_files)) == 0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [record for record in records if "episode/turns" in record]
    assert len(steps) == 2 and all(1 <= record["episode/turns"] <= 3 for record in steps)
    assert max(record["episode/context_tokens"] for record in steps) > 0
    assert max(record["reward/turn"] for record in steps) > 0 and steps[-1]["perf/environment_s"] >= 0
