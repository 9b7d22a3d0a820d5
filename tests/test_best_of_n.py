"""Best-of-N rejection sampling: the selection, the fine-tuning on the winners, a whole run with resume."""

import math
import warnings

import pytest
import torch
import yaml
from helpers import comparable, run_cli, toy_trainer, write_config
from sample_environments import SPEC as EPISODES

from lmppo.errors import LmppoError
from lmppo.inputs.config import load_config
from lmppo.inputs.resolve import resolve
from lmppo.runs.checkpoint import latest_checkpoint, load_checkpoint
from lmppo.sampling.passes import sequence_logprobs
from lmppo.training.best_of_n import best_of_groups
from lmppo.training.metrics import read_metrics

BON = (
    "run.algorithm=best_of_n",
    "rollout.samples_per_prompt=4",
    "rollout.batch_size=4",
    "ppo.minibatch_size=4",
)


def test_the_best_of_each_group_is_kept_first_of_ties_and_above_the_threshold():
    scores = torch.tensor([0.0, 2.0, 1.0, 5.0, 5.0, -1.0, -3.0, -2.0, -4.0])
    assert best_of_groups(scores, 3).tolist() == [1, 3, 7]  # 5.0 twice: the first
    assert best_of_groups(scores, 3, threshold=0.0).tolist() == [1, 3]


def test_a_round_fine_tunes_on_the_winners_and_their_likelihood_rises():
    trainer = toy_trainer(*BON, "ppo.lr=1e-2", "best_of_n.epochs=4")
    assert trainer.value_model is None
    scored, _ = trainer.scorer.score(trainer.sampler.collect(0), 0, {})
    winners = scored.select(best_of_groups(scored.rm_score, 4))
    first = trainer.fine_tune(winners)
    losses = [trainer.sft_update(winners)[0] for _ in range(3)]
    assert first.updates == 4 and first.policy_moved
    assert losses[-1] < first.metrics["sft/loss"] and losses == sorted(losses, reverse=True)


def test_with_an_environment_episodes_are_judged_whole_and_only_their_actions_are_learnt():
    """Best-of-n on episodes: the pick reads the reward plus the turn rewards, and the fine-tuning loss is
    the token mean over the policy's own tokens, never the context an environment put between them."""
    trainer = toy_trainer(*BON, f"rollout.environment={EPISODES}", "rollout.max_turns=3")
    scored, _ = trainer.scorer.score(trainer.sampler.collect(0), 0, {})
    assert scored.episode.context_mask.sum() > 0 and scored.episode.turn_rewards.sum() > 0
    assert torch.equal(scored.episode_score, scored.rm_score + scored.episode.turn_rewards.sum(1))
    winners = scored.select(best_of_groups(scored.episode_score, 4))
    with torch.no_grad():
        logp = sequence_logprobs(trainer.policy, winners)  # teacher-forced, every response position
    actions_only = -(logp * winners.action_mask).sum() / winners.action_mask.sum()
    with_context = -(logp * winners.response_mask).sum() / winners.response_mask.sum()
    loss, _, _ = trainer.sft_update(winners)  # one minibatch: the loss before its step
    assert loss == pytest.approx(actions_only.item(), rel=1e-6)
    # near-uniform toy: every token costs about log V, so the context moves the mean only a little, but
    # far more than the tolerance above
    assert abs(with_context.item() - loss) > 1e-5
    metrics = trainer.step()
    assert metrics["episode/turns"] > 1 and metrics["bon/winner_score"] >= metrics["reward/turn"]


def test_no_winner_above_the_threshold_leaves_the_policy_as_it_was():
    trainer = toy_trainer(*BON, "best_of_n.threshold=100")
    before = {k: p.detach().clone() for k, p in trainer.policy.named_parameters()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the schedule moves on without an optimizer step: no torch warning
        metrics = trainer.step()
    assert metrics["bon/kept_frac"] == 0 and metrics["policy/updates"] == 0 and trainer.policy_version == 0
    assert "bon/winner_score" not in metrics and all(math.isfinite(v) for v in metrics.values())
    assert all(torch.equal(p, before[k]) for k, p in trainer.policy.named_parameters())
    assert not any(key.startswith(("adv/", "value/", "reward/kl_penalty")) for key in metrics)


def test_best_of_n_needs_groups_and_one_process(run_files):
    with pytest.raises(LmppoError, match="set rollout.samples_per_prompt to K >= 2"):
        resolve(load_config(run_files, ["run.algorithm=best_of_n"]), device="cpu")
    cfg = load_config(run_files, ["run.algorithm=best_of_n", "rollout.samples_per_prompt=2"])
    assert resolve(cfg, device="cpu").value is None
    with pytest.raises(LmppoError, match="best-of-n runs in one process"):
        resolve(cfg, device="cpu", world_size=2)


@pytest.mark.slow
def test_best_of_n_runs_end_to_end_and_resumes_exactly_between_rounds(run_files):
    """The CI-sized run: 4 rounds in one go == 2 rounds, stop, resume for 2 (metrics and weights); the
    run directory holds what a PPO run's does, without a critic."""
    rounds = {"samples_per_prompt": 3, "batch_size": 2}
    straight = write_config(
        run_files, rollout=rounds, run={"steps": 4, "output_dir": str(run_files.parent / "a")}
    )
    assert run_cli("best-of-n", str(straight)) == 0
    split = write_config(straight, run={"steps": 2, "output_dir": str(run_files.parent / "b")})
    assert run_cli("best-of-n", str(split)) == 0
    assert run_cli("best-of-n", "--resume", str(run_files.parent / "b"), "run.steps=4") == 0
    a, b = run_files.parent / "a", run_files.parent / "b"
    records = read_metrics(a)
    assert comparable(records) == comparable(read_metrics(b))
    assert [r["step"] for r in records if "bon/kept_frac" in r] == [1, 2, 3, 4]
    saved_a, saved_b = (load_checkpoint(latest_checkpoint(d)).tensors for d in (a, b))
    assert "value" not in saved_a and all(
        torch.equal(saved_a["policy"][k], saved_b["policy"][k]) for k in saved_a["policy"]
    )
    assert (a / "final" / "config.json").is_file()
    assert yaml.safe_load((b / "config.yaml").read_text())["run"]["algorithm"] == "best_of_n"


def test_the_command_names_the_algorithm_and_a_contradicting_override_is_refused(run_files, capsys):
    assert run_cli("ppo", str(run_files), "run.algorithm=best_of_n", "rollout.samples_per_prompt=2") == 2
    assert "use `lmppo best-of-n CONFIG ...` without the override" in " ".join(
        capsys.readouterr().err.split()
    )
    assert not (run_files.parent / "run").exists()  # refused before anything was written
