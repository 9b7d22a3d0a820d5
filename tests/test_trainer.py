"""The PPO step: learning on the seeds' toy reward, early stop, stale rollouts, ptx, accumulation."""

import dataclasses
import math

import pytest
import torch
from helpers import DYNAMIC_SAMPLING, PROMPTS, scored_by, signal_on_cats, toy_models, toy_trainer

from lmppo.errors import LmppoError
from lmppo.modeling.lora import make_reference
from lmppo.training.advantages import estimate
from lmppo.training.metrics import METRIC_NAMES
from lmppo.training.sft import sft_batch


@pytest.mark.slow
def test_train_ppo_increases_reward_with_bounded_kl():
    """The seeds' sixth test: reward "count the token good" rises; the per-sequence KL stays bounded.

    The gain over 12 steps follows the CPU's float rounding: on 2026-12-01's AMD EPYC seeds 0-7 gained
    0.87-1.37 from 0.03 (seed 0: 0.87, where another machine's CI had passed a +1.0 bar)."""
    trainer = toy_trainer("rollout.batch_size=16", "ppo.minibatch_size=8", "kl.beta=0.3")
    history = [trainer.step() for _ in range(12)]
    first = sum(m["reward/rm_score"] for m in history[:2]) / 2
    last = sum(m["reward/rm_score"] for m in history[-3:]) / 3
    assert last > first + 0.5, (first, last)  # a trainer that does not learn stays near 0.03
    assert all(m["kl/ref"] < 8.0 for m in history)  # bounded: far below 8 tokens * log(V) ~ 31 nats
    assert all(math.isfinite(v) for m in history for v in m.values())


def test_first_update_sees_ratio_one_and_metrics_are_complete():
    """Stored logp_old equals the update's forward: at the first minibatch the ratio is exactly 1."""
    trainer = toy_trainer("ppo.ppo_epochs=1", "ppo.minibatch_size=8")  # one update per step
    metrics = trainer.step()
    assert metrics["policy/approx_kl"] < 1e-6
    assert abs(metrics["policy/ratio_mean"] - 1.0) < 1e-5 and metrics["policy/clip_frac"] == 0.0
    assert metrics["engine/logp_gap"] < 1e-5  # the decode loop's log-probs are the trainer's
    expected = {
        name
        for name in METRIC_NAMES
        if not name.startswith(
            (
                "eval/",
                "ptx/",
                "reward/rm_score_used",
                "reward/eos_penalty",
                "reward/norm",
                "reward/clip",
                "reward/overlong_penalty",  # reward.overlong_buffer only
                "perf/allreduce_mb",
                "perf/allgather_mb",
                "perf/reduce_scatter_mb",
                "perf/peak_gpu_mb",
                "perf/compiles",  # run.compile only
                "perf/generation_batch_tokens",  # logged once an out-of-memory error halved them
                "perf/forward_batch_tokens",
                "perf/micro_batch_tokens",
                "engine/tis_clip_frac",
                "perf/weight_sync_s",
                "policy/kl_loss",  # kl.in_loss only
                "adv/flat_group_frac",  # group baselines only
                "rollout/",  # rollout.dynamic_sampling only
                "bon/",  # best-of-n rounds only
                "episode/",  # an environment's episodes only
                "reward/turn",
                "reward/total",
                "perf/environment_s",
                "sft/",
            )
        )
    }
    assert expected <= set(metrics), expected - set(metrics)
    assert all(math.isfinite(v) for v in metrics.values())
    assert metrics["policy/updates"] == 1 and trainer.policy_version == 1


def test_bf16_precision_runs_the_passes_in_bf16_and_keeps_fp32_masters():
    """bf16 autocast changes the log-probs by bf16 rounding only; what is trained stays fp32."""
    first_rollouts = {}
    for precision in ("fp32", "bf16"):
        trainer = toy_trainer(
            f"run.precision={precision}",
            "ppo.ppo_epochs=1",
            "ppo.minibatch_size=8",
            models=toy_models(head_scale=1.0),  # logits large enough for bf16 rounding to show
        )
        with trainer.autocast():
            first_rollouts[precision] = trainer.sampler.collect(trainer.policy_version)
        metrics = trainer.step()
        assert abs(metrics["policy/ratio_mean"] - 1.0) < 1e-2 and metrics["engine/logp_gap"] < 1e-2
    fp32, bf16 = first_rollouts["fp32"], first_rollouts["bf16"]
    assert torch.equal(fp32.response_ids, bf16.response_ids)  # same draws ...
    gap = (fp32.logp_old - bf16.logp_old).abs()[fp32.response_mask.bool()]
    assert 0 < gap.max() < 5e-2  # ... from logits rounded to bf16
    states = [s for s in trainer.optimizer.state.values()]
    assert states and all(s["exp_avg"].dtype == torch.float32 for s in states)
    assert all(p.dtype == torch.float32 for p in trainer.policy.parameters())


def test_fast_fp32_is_set_process_wide_by_the_trainer_and_the_next_trainer_resets_it():
    """run.fp32_matmul_precision is torch's global setting: each trainer sets its run's value."""
    try:
        trainer = toy_trainer("run.fp32_matmul_precision=medium", "ppo.ppo_epochs=1", "ppo.minibatch_size=8")
        assert torch.get_float32_matmul_precision() == "medium"
        metrics = trainer.step()
        assert metrics["engine/logp_gap"] < 1e-2  # the decode loop and the update round alike
        toy_trainer()
        assert torch.get_float32_matmul_precision() == "highest"
    finally:
        torch.set_float32_matmul_precision("highest")


def test_approx_kl_early_stop_cuts_the_epochs():
    trainer = toy_trainer("ppo.ppo_epochs=4", "ppo.target_approx_kl=1e-9", "ppo.lr=1e-2")
    trainer.step()  # the first step moves the policy; the second's first epoch overshoots the tiny target
    assert trainer.step()["policy/epochs"] == 1
    relaxed = toy_trainer("ppo.ppo_epochs=4")
    relaxed.step()
    assert relaxed.step()["policy/epochs"] == 4


class Wrapped:
    """A generator around another: syncing and closing are the inner one's (the Generator protocol)."""

    def sync_weights(self, policy, policy_version):
        self.inner.sync_weights(policy, policy_version)

    def close(self, abandon=False):
        self.inner.close(abandon)


class StaleGenerator(Wrapped):
    """Wraps a generator and stamps its rollouts as sampled ``age`` policy versions ago."""

    def __init__(self, inner, ages):
        self.inner, self.ages, self.calls = inner, list(ages), 0

    def generate(self, prompts, policy_version, sample_ids=None, rows=None):
        self.calls += 1
        age = self.ages.pop(0) if self.ages else 99
        return dataclasses.replace(
            self.inner.generate(prompts, policy_version, sample_ids), policy_version=policy_version - age
        )


class OffByEngine(Wrapped):
    """Samples like the trainer but reports log-probs shifted by ``shift``, as a mismatched engine would."""

    def __init__(self, inner, shift):
        self.inner, self.shift = inner, shift

    def generate(self, prompts, policy_version, sample_ids=None, rows=None):
        rollout = self.inner.generate(prompts, policy_version, sample_ids)
        self.true_logp = rollout.logp_old.clone()
        return dataclasses.replace(rollout, logp_old=rollout.logp_old - self.shift)


def test_truncated_importance_sampling_corrects_an_engine_gap():
    """ppo.tis_cap: the ratio is taken against the trainer's own log-probs (exactly 1 before the update), the
    gap is reported, and tokens are weighted by min(p_trainer / p_engine, cap) = min(e^0.5, 1.5) = 1.5."""
    metrics = {}
    for cap in (None, 1.5):
        trainer = toy_trainer(
            "ppo.ppo_epochs=1", "ppo.minibatch_size=8", *([f"ppo.tis_cap={cap}"] if cap else [])
        )
        trainer.sampler.generator = OffByEngine(trainer.generator, shift=0.5)
        metrics[cap] = trainer.step()
    assert metrics[None]["engine/logp_gap"] == pytest.approx(0.5, abs=1e-4)
    assert metrics[None]["policy/ratio_mean"] == pytest.approx(math.exp(0.5), rel=1e-3)  # off-policy ratio
    assert metrics[1.5]["engine/logp_gap"] == pytest.approx(0.5, abs=1e-4)  # still the engine's gap
    assert metrics[1.5]["policy/ratio_mean"] == pytest.approx(
        1.0, abs=1e-5
    )  # against the trainer's log-probs
    assert metrics[1.5]["engine/tis_clip_frac"] == 1.0  # every weight e^0.5 > 1.5 is capped
    assert "engine/tis_clip_frac" not in metrics[None]


def test_stale_rollouts_are_refused_and_regenerated():
    trainer = toy_trainer("rollout.max_rollout_age=1")
    trainer.sampler.generator = StaleGenerator(trainer.generator, [5, 1])  # too old, then acceptable
    metrics = trainer.step()
    assert trainer.generator.calls == 2 and metrics["lag/policy_versions"] == 1
    trainer.sampler.generator = StaleGenerator(trainer.generator.inner, [])  # always too old
    with pytest.raises(LmppoError, match="max_rollout_age=1"):
        trainer.step()


def test_ptx_loss_is_logged_when_enabled():
    models = toy_models()

    demos = [{"prompt": "tell me about the cat", "response": "the cat is good"}] * 4
    trainer = toy_trainer(
        "ppo.ptx_coef=0.5", models=models, ptx_batches=lambda: sft_batch(models.tokenizer, demos)
    )
    metrics = trainer.step()
    assert metrics["ptx/loss"] > 0 and math.isfinite(metrics["ptx/loss"])
    assert "ptx/loss" not in toy_trainer().step()


def first_update_gradients(trainer) -> torch.Tensor:
    """The policy's accumulated gradients at the first optimiser step of ``trainer.step()``."""
    seen = []
    hook = trainer.optimizer.register_step_pre_hook(
        lambda *_: seen.append(
            torch.cat([p.grad.flatten() for p in trainer.policy.parameters() if p.grad is not None])
        )
    )
    trainer.step()
    hook.remove()
    return seen[0]


def test_micro_batch_accumulation_equals_the_full_minibatch():
    """Token-weighted accumulation over micro-batches gives the gradient of one pass, and so the same update.

    The gradients are compared before the first optimiser step. The weights after the whole step agree to
    1e-5 rather than to float precision: Adam's first step is about lr * g / |g| per weight, so a weight
    whose gradient is near 0 turns float-order noise (which differs between CPUs) into a visible change.
    """
    weights, gradients = [], []
    for micro in (None, 2, 1):
        overrides = ["ppo.ppo_epochs=1"] + ([f"ppo.micro_batch_size={micro}"] if micro else [])
        trainer = toy_trainer(*overrides, models=toy_models())
        gradients.append(first_update_gradients(trainer))
        weights.append(torch.cat([p.detach().flatten() for p in trainer.policy.parameters()]))
    for gradient in gradients[1:]:
        torch.testing.assert_close(gradient, gradients[0], atol=1e-8, rtol=1e-4)
    assert torch.allclose(weights[0], weights[1], atol=1e-5) and torch.allclose(
        weights[0], weights[2], atol=1e-5
    )


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_gradient_checkpointing_recomputes_each_layer_and_gives_the_same_gradients(lora, monkeypatch):
    from transformers.models.llama import modeling_llama

    from lmppo.inputs.config import LoraConfig
    from lmppo.modeling.lora import with_lora
    from lmppo.modeling.models import enable_gradient_checkpointing

    def models(checkpointed: bool):
        built = toy_models()
        if lora:
            built.policy = with_lora(built.policy, LoraConfig(enabled=True, r=4, alpha=8))
            built.reference = make_reference(built.policy)
        if checkpointed:
            enable_gradient_checkpointing(built.policy)
            enable_gradient_checkpointing(built.value)
        return built

    mlp_forward, calls = modeling_llama.LlamaMLP.forward, []
    monkeypatch.setattr(
        modeling_llama.LlamaMLP, "forward", lambda self, x: calls.append(1) or mlp_forward(self, x)
    )
    gradients, mlp_calls = [], []
    for checkpointed in (False, True):
        trainer = toy_trainer("ppo.ppo_epochs=1", "ppo.minibatch_size=8", models=models(checkpointed))
        assert bool(trainer.train_module.checkpointed) == checkpointed
        calls.clear()
        gradients.append(first_update_gradients(trainer))
        mlp_calls.append(len(calls))
    torch.testing.assert_close(gradients[1], gradients[0], atol=1e-7, rtol=1e-5)
    # one update on one micro-batch: the backward recomputes each of the 4 layers (2 policy, 2 critic) once
    assert mlp_calls[1] == mlp_calls[0] + 4


def test_token_budget_micro_batches_give_the_gradient_of_one_pass():
    """ppo.micro_batch_tokens: each forward holds at most the budget (padding included), rows longest first,
    and the token-weighted accumulation gives the same gradient as one pass over the minibatch."""
    from lmppo.sampling.rollout import token_budget_micro_batches

    whole = toy_trainer("ppo.ppo_epochs=1", "ppo.minibatch_size=8")
    reference = first_update_gradients(whole)
    budgeted = toy_trainer("ppo.ppo_epochs=1", "ppo.minibatch_size=8", "ppo.micro_batch_tokens=40")
    seen = []
    minibatch_update = budgeted.minibatch_update

    def recording(minibatch, *args):
        seen.append(list(token_budget_micro_batches(minibatch, 40)))
        return minibatch_update(minibatch, *args)

    budgeted.minibatch_update = recording
    torch.testing.assert_close(first_update_gradients(budgeted), reference, atol=1e-8, rtol=1e-4)
    micro_batches = seen[0]
    assert len(micro_batches) > 1 and sum(len(m) for m in micro_batches) == 8
    for micro in micro_batches:
        positions = micro.query_ids.shape[1] + micro.response_ids.shape[1]
        assert len(micro) * positions <= 40 or len(micro) == 1  # a row over the budget goes alone


@pytest.mark.parametrize("shared", [False, True], ids=["separate", "shared-trunk"])
def test_critic_warmup_trains_only_the_critic_then_the_policy(shared):
    from lmppo.modeling.models import ValueModel

    models = toy_models()
    if shared:
        models.value = ValueModel.shared_trunk(models.policy)
    critic = "models.value.mode=" + ("shared" if shared else "separate")
    trainer = toy_trainer("ppo.critic_warmup_steps=2", "ppo.lr=1e-2", critic, models=models)
    start = [p.detach().clone() for p in trainer.policy.parameters()]
    head = trainer.value_model.head.weight.detach().clone()
    for _ in range(2):
        metrics = trainer.step()
        assert metrics["policy/frozen"] == 1.0
    assert all(
        torch.equal(a, b) for a, b in zip(start, trainer.policy.parameters())
    )  # the policy is as it was
    assert trainer.policy_version == 0 and not torch.equal(
        head, trainer.value_model.head.weight
    )  # the critic learnt
    assert trainer.step()["policy/frozen"] == 0.0 and trainer.policy_version == 1
    assert not all(torch.equal(a, b) for a, b in zip(start, trainer.policy.parameters()))


def prompt_only(prompts, responses) -> torch.Tensor:
    """A reward the policy cannot move: it reads the prompt alone."""
    return torch.tensor([float(len(str(p))) / 10 for p in prompts])


@pytest.mark.slow
def test_a_hackable_component_rises_apart_from_one_the_policy_cannot_move():
    """Two reward components, logged apart: count_good climbs, the prompt-only score stays where it was,
    and the score PPO uses is the weighted sum of the two."""
    from helpers import COUNT_GOOD

    from lmppo.rewards.scoring import CombinedReward, ScoredComponent, load_reward_function

    models = dataclasses.replace(
        toy_models(),
        reward=CombinedReward(
            [
                ScoredComponent("good", load_reward_function(COUNT_GOOD)),
                ScoredComponent("prompt", prompt_only, weight=0.5),
            ],
            named=True,
        ),
    )
    trainer = toy_trainer("rollout.batch_size=16", "ppo.minibatch_size=8", "kl.beta=0.3", models=models)
    history = [trainer.step() for _ in range(12)]
    good = [m["reward/good/raw"] for m in history]
    assert sum(good[-3:]) / 3 > sum(good[:2]) / 2 + 0.3  # climbs (+0.56 on the machine of 2026-12-01)
    fixed = [m["reward/prompt/raw"] for m in history]
    assert fixed == pytest.approx([fixed[0]] * len(fixed))  # every step scores the same 16 prompts
    for m in history:
        assert m["reward/rm_score_used"] == pytest.approx(m["reward/good/used"] + m["reward/prompt/used"])
        assert m["reward/prompt/used"] == pytest.approx(0.5 * m["reward/prompt/raw"])


def test_a_shared_trunk_critic_takes_its_stored_values_from_the_decode_loop():
    """No values pass (``perf/values_s`` 0), and the step's numbers are those of the values pass."""
    from lmppo.modeling.models import ValueModel
    from lmppo.runs.build import generator_options
    from lmppo.sampling.hf_engine import hf_generator

    def shared_models():
        models = toy_models()
        models.value = ValueModel.shared_trunk(models.policy)
        torch.nn.init.normal_(models.value.head.weight, std=0.1)  # values that are not all 0
        return models

    reads = toy_trainer("models.value.mode=shared", models=shared_models())
    read_metrics = reads.step()  # each trainer seeds the global generator: build and step one at a time
    models = shared_models()
    plain = hf_generator(models.policy, models.tokenizer, **generator_options(reads.cfg))  # no value model
    pass_metrics = toy_trainer("models.value.mode=shared", models=models, generator=plain).step()
    assert read_metrics["perf/values_s"] == 0.0 < pass_metrics["perf/values_s"]
    for name, value in pass_metrics.items():
        if not name.startswith("perf/") and name != "lag/rollout_age_s":  # wall-clock times
            assert math.isclose(read_metrics[name], value, rel_tol=1e-4, abs_tol=1e-5), name


@pytest.mark.parametrize(
    ("advantage", "samples"), [("grpo", 4), ("dr_grpo", 4), ("rloo", 4), ("reinforce_pp", 1)]
)
def test_critic_free_estimators_learn_the_seeds_reward_with_no_value_model(advantage, samples):
    """The seeds' "count good" reward rises under every critic-free estimator (2026-12-03, AMD EPYC:
    0.03 -> 0.67-1.08 in 12 steps of 16 responses), with no critic to step and no value metric logged."""
    trainer = toy_trainer(
        f"ppo.advantage={advantage}",
        f"rollout.samples_per_prompt={samples}",
        f"rollout.batch_size={16 // samples}",
        "ppo.minibatch_size=8",
        "kl.beta=0.3",
    )
    assert trainer.value_model is None and [g["name"] for g in trainer.optimizer.param_groups] == ["policy"]
    history = [trainer.step() for _ in range(12)]
    first = sum(m["reward/rm_score"] for m in history[:2]) / 2
    last = sum(m["reward/rm_score"] for m in history[-3:]) / 3
    assert last > first + 0.4, (first, last)
    assert not any(key.startswith("value/") for m in history for key in m)
    assert ("adv/flat_group_frac" in history[0]) == (samples > 1)
    assert history[-1]["policy/updates"] == 2 * 2  # 16 responses / minibatches of 8, two epochs
    assert trainer.episodes == 12 * 16  # responses, not prompts


def test_kl_in_the_loss_holds_the_policy_near_the_reference_and_is_named_in_the_metrics():
    """GRPO's placement: no KL in the reward (no reward/kl_penalty), a k3 loss term (policy/kl_loss)
    that is 0 while the policy is the reference and, weighted heavily, keeps the policy near it."""
    group = (
        "ppo.advantage=rloo",
        "rollout.samples_per_prompt=4",
        "rollout.batch_size=4",
        "ppo.minibatch_size=8",
    )
    free = toy_trainer(*group, "kl.beta=0")
    held = toy_trainer(*group, "kl.beta=20", "kl.in_loss=true", "ppo.ppo_epochs=1", "ppo.minibatch_size=16")
    first = held.step()
    assert (
        "reward/kl_penalty" not in first and first["policy/kl_loss"] < 1e-9
    )  # one update, from the reference
    assert "policy/kl_loss" not in free.step()
    free_kl = [free.step()["kl/ref"] for _ in range(8)]
    held_kl = [held.step()["kl/ref"] for _ in range(8)]
    assert max(held_kl) < 0.5 * max(free_kl), (held_kl, free_kl)


def test_sequence_mean_weighs_every_response_alike_where_token_mean_weighs_every_token():
    """At the first update the ratio is 1, so the policy loss is minus the advantages' mean: over tokens
    (0 after whitening), or over responses of each response's own mean (not 0 on ragged responses)."""
    for aggregation in ("token_mean", "sequence_mean"):
        trainer = toy_trainer(f"ppo.loss_aggregation={aggregation}")
        torch.manual_seed(3)
        rollout = trainer.generator.generate(PROMPTS * 2, trainer.policy_version)
        scored, _ = trainer.scorer.score(rollout, trainer.policy_version, {})
        rollout, _ = estimate(scored, trainer.kl_controller.value, trainer.spec.estimator)
        rollout = rollout.select(torch.arange(len(rollout)))  # as a minibatch: out of inference mode
        mask, advantages = rollout.response_mask, rollout.advantages
        assert 0 < mask.sum(1).min() < mask.sum(1).max()  # ragged responses
        mean_length = mask.sum() / len(rollout)
        means, _, _ = trainer.micro_batch_loss(rollout, mean_length)
        row_means = (advantages * mask).sum(1) / mask.sum(1)
        expected = (
            -row_means.mean() if aggregation == "sequence_mean" else -(advantages * mask).sum() / mask.sum()
        )
        assert means.policy_loss == pytest.approx(expected.item(), abs=1e-6)
    assert abs(row_means.mean().item()) > 1e-3  # the two aggregations differ here


def test_asynchronous_rollouts_are_one_version_behind_and_the_ratio_is_taken_against_the_sampler():
    """rollout.asynchronous: step 1 samples first (lag 0); from then on each batch was sampled during the
    previous update, by the weights before it (lag 1), so the trainer's log-probs already differ from the
    sampler's at the first minibatch; the snapshot engine holds the policy again after every sync."""
    trainer = toy_trainer("rollout.asynchronous=true")
    assert trainer.cfg.rollout.max_rollout_age == 1  # unset: one version for one-step-off
    records = [trainer.step() for _ in range(3)]
    assert [r["lag/policy_versions"] for r in records] == [0.0, 1.0, 1.0]
    assert records[0]["engine/logp_gap"] < 1e-5 < records[1]["engine/logp_gap"]
    assert all(r["perf/generation_s"] > 0 for r in records)
    assert trainer.sampler.ahead.pending is not None  # step 4's batch is sampling already
    trainer.sampler.ahead.finished()
    snapshot = dict(trainer.generator.engine.model.named_parameters())
    assert all(torch.equal(p, snapshot[name]) for name, p in trainer.policy.named_parameters())
    assert trainer.generator.engine.synced_version == trainer.policy_version == 3


def test_overlong_shaping_takes_its_penalty_from_the_score():
    """DAPO's overlong shaping on the same samples: the score used is the plain one less the penalty, which
    rows within 4 tokens of the 8-token limit pay (an untrained toy policy runs long)."""
    plain = toy_trainer().step()
    shaped = toy_trainer("reward.overlong_buffer=4", "reward.overlong_penalty=0.5").step()
    assert shaped["response/length"] == plain["response/length"]  # the same samples
    assert 0 < shaped["reward/overlong_penalty"] <= 0.5 and "reward/overlong_penalty" not in plain
    assert shaped["reward/rm_score_used"] == pytest.approx(
        plain["reward/rm_score"] - shaped["reward/overlong_penalty"]  # plain: the raw score is the one used
    )


def test_dynamic_sampling_replaces_flat_groups_with_new_prompts():
    """Half the prompts give groups that all score alike: they are set aside and the next prompts are
    sampled until 8 groups with a signal fill the batch; the rows keep the scores sampling gave them."""
    trainer = toy_trainer(*DYNAMIC_SAMPLING, models=scored_by(signal_on_cats))
    rollout = trainer.sampler.sample(trainer.policy_version, {})
    assert len(rollout) == 16 and all("cat" in str(p) or "happy" in str(p) for p in rollout.prompts)
    assert trainer.sampler.metrics["rollout/flat_groups_kept"] == 0
    assert trainer.sampler.metrics["rollout/extra_rounds"] >= 1  # 4 of each round's 8 prompts are flat
    dropped, signal = (
        trainer.sampler.metrics[k] for k in ("rollout/flat_groups_dropped", "rollout/signal_groups")
    )
    assert signal >= 8 and dropped == 8 * (1 + trainer.sampler.metrics["rollout/extra_rounds"]) - signal
    assert torch.equal(
        torch.tensor(rollout.reward_raw)[:, 0], signal_on_cats(rollout.prompts, rollout.response_texts)
    )
    metrics = trainer.step()
    assert metrics["adv/flat_group_frac"] == 0.0 and metrics["rollout/flat_groups_kept"] == 0


def test_dynamic_sampling_gives_up_after_its_rounds_and_keeps_flat_groups():
    flat = scored_by(lambda prompts, responses: torch.ones(len(prompts)))
    trainer = toy_trainer(
        "rollout.samples_per_prompt=2", "rollout.dynamic_sampling=true", "rollout.dynamic_sampling_rounds=2",
        "ppo.advantage=grpo", models=flat,
    )  # fmt: skip
    metrics = trainer.step()
    assert metrics["rollout/extra_rounds"] == 2 and metrics["rollout/signal_groups"] == 0
    assert metrics["rollout/flat_groups_kept"] == 8 and metrics["rollout/flat_groups_dropped"] == 16
    assert metrics["adv/flat_group_frac"] == 1.0
    with pytest.raises(LmppoError, match="samples_per_prompt=1 makes groups of one"):
        toy_trainer("rollout.dynamic_sampling=true")
    with pytest.raises(LmppoError, match="rollout.asynchronous has sampled the next batch already"):
        toy_trainer(
            "rollout.samples_per_prompt=2", "rollout.dynamic_sampling=true", "rollout.asynchronous=true"
        )
