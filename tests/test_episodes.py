"""Multi-turn episodes (lmppo.sampling.episodes): the action/context record of a hand-built episode, the
PPO contract over actions only, environments that break, and a PPO run that trains on one."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from helpers import PROMPTS, ROLE_TEMPLATE, boost_token, role_tokenizer, run_cli, toy_models, toy_trainer
from sample_environments import AnswerTwice

from lmppo.errors import LmppoError
from lmppo.inputs.data import encode_chat, encode_context
from lmppo.math import core
from lmppo.math.core import token_logprobs
from lmppo.sampling.environments import Step
from lmppo.sampling.episodes import EpisodeGenerator
from lmppo.sampling.hf_engine import hf_generator
from lmppo.sampling.passes import response_logits
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


def episodes(environment, *, model=None, max_turns=4, max_total_tokens=64, max_new_tokens=4):
    """An episode engine on a tiny Llama; by default one that always ends its turn at once (EOS)."""
    tok = role_tokenizer()
    if model is None:
        torch.manual_seed(0)
        model = toy_models().policy
        model.resize_token_embeddings(len(tok))
        boost_token(model, tok.eos_token_id, 12.0)
    generator = hf_generator(model, tok, max_new_tokens=max_new_tokens)
    return EpisodeGenerator(
        generator.engine,
        generator.renderer,
        environment,
        name="tests:Env",
        max_turns=max_turns,
        max_total_tokens=max_total_tokens,
        seed=3,
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


class Garbage(Raises):
    def step(self, text):
        return {"messages": [], "done": True}


class NeverEnds(Raises):
    def step(self, text):
        return Step(messages=[{"role": "user", "content": "again"}])


def test_a_broken_environment_stops_with_a_message_naming_it():
    with pytest.raises(LmppoError, match=r"rollout.environment tests:Env \(step\) raised KeyError"):
        episodes(Raises).generate(["tell me"], 0)
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
