"""Data parallelism: one PPO step on 2 gloo ranks equals the step on 1 process; torchrun through the CLI."""

import dataclasses
import json
import math
import os
import shutil
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import (
    DYNAMIC_SAMPLING,
    FAILS_ON_RANK1,
    GOOD_JUDGE,
    LOSES_RANK1,
    boost_token,
    comparable,
    run_cli,
    scored_by,
    signal_on_cats,
    torchrun,
    toy_models,
    toy_trainer,
    write_config,
)
from safetensors.torch import load_file
from sample_environments import AnswerTwice
from transformers import AutoModelForCausalLM

from lmppo.inputs.config import LoraConfig
from lmppo.modeling.distributed import full_tensor, join_shards, seed_everything, trained_state_bytes
from lmppo.modeling.lora import make_reference, with_lora
from lmppo.modeling.models import ValueModel
from lmppo.runs.checkpoint import latest_checkpoint, load_checkpoint
from lmppo.sampling.engines import policy_weights
from lmppo.sampling.episodes import EpisodeGenerator
from lmppo.sampling.hf_engine import hf_generator
from lmppo.training.metrics import read_metrics, reduce_metrics

BATCH = 8
# one minibatch of the whole batch (every rank's rows), two epochs, micro-batches of 4 rows (2 per rank)
STEP_OVERRIDES = (
    "rollout.max_new_tokens=8",
    f"rollout.batch_size={BATCH}",
    f"ppo.minibatch_size={BATCH}",
    "ppo.micro_batch_size=4",
    "ppo.ppo_epochs=2",
    "ppo.lr=1e-2",
    "ppo.adam_eps=1e-5",
)
GLOBAL_METRICS = (
    "policy/loss",
    "value/loss",
    "policy/approx_kl",
    "policy/entropy",
    "policy/clip_frac",
    "policy/ratio_mean",
    "adv/mean",
    "adv/std",
    "value/explained_var",
    "kl/ref",
    "reward/rm_score",
    "response/length",
    "policy/grad_norm",
    "value/grad_norm",
)


class FixedRollouts:
    """A generator that hands out the same pre-sampled rollout (one rank's shard of it)."""

    decode_budget = None  # samples nothing: no decode batches to shrink

    def __init__(self, rollout):
        self.rollout = rollout

    def generate(self, prompts, policy_version, sample_ids=None, rows=None):
        return dataclasses.replace(self.rollout, policy_version=policy_version)

    def sync_weights(self, policy, policy_version):
        pass  # samples nothing: there are no weights to take

    def close(self, abandon=False):
        pass


def fixed_global_rollout(tmp_path):
    """A sampled batch of BATCH responses, written to a file and read back as every run's input."""
    models = toy_models()
    seed_everything(3)
    rollout = hf_generator(models.policy, models.tokenizer, max_new_tokens=8).generate(
        ["tell me about the cat", "write a short poem", "tell me a story", "the day was very happy"] * 2,
        policy_version=0,
    )
    assert 0 < rollout.response_mask.sum(1).min() < rollout.response_mask.sum(1).max()  # ragged lengths
    torch.save(rollout, tmp_path / "rollout.pt")
    return torch.load(tmp_path / "rollout.pt", weights_only=False)


def fixed_episode_rollout(tmp_path):
    """BATCH multi-turn episodes (:class:`AnswerTwice`), sampled once by the toy policy with its EOS made
    likelier (short turns, so that episodes hold context between them), read back from a file."""
    models = toy_models()
    boost_token(models.policy, models.tokenizer.eos_token_id, 3.0)
    seed_everything(3)
    generator = hf_generator(models.policy, models.tokenizer, max_new_tokens=6)
    episodes = EpisodeGenerator(
        generator.engine,
        generator.renderer,
        AnswerTwice,
        name="tests",
        max_turns=3,
        max_total_tokens=40,
        seed=3,
    )
    rollout = episodes.generate(
        ["tell me about the cat", "write a short poem", "tell me a story", "the day was very happy"] * 2, 0
    )
    assert (
        rollout.episode.context_mask.sum(1).min() == 0 < rollout.episode.context_mask.sum(1).max()
    )  # some hold context
    torch.save(rollout, tmp_path / "episodes.pt")
    return torch.load(tmp_path / "episodes.pt", weights_only=False)


VARIANTS = {  # what the config says of the models step_models makes
    "full": (),
    "lora": ("models.policy_lora.enabled=true", "models.policy_lora.r=4", "models.policy_lora.alpha=8"),
    "shared": ("models.value.mode=shared",),
    # 4 prompts x 2 samples (rows 2i, 2i + 1 are one group): each rank's contiguous shard holds whole groups
    "rloo": ("ppo.advantage=rloo", "rollout.samples_per_prompt=2", f"rollout.batch_size={BATCH // 2}"),
    "episodes": (),  # the rollout is multi-turn episodes: actions with context between them
}


def step_models(variant: str):
    """The toy models, with LoRA on the policy (``lora``) or the critic on the policy's trunk (``shared``)."""
    models = toy_models()
    if variant == "lora":
        models.policy = with_lora(models.policy, LoraConfig(enabled=True, r=4, alpha=8))
        models.reference = make_reference(models.policy)
    if variant == "shared":
        models.value = ValueModel.shared_trunk(models.policy)
    if variant == "rloo":
        models.value = None
    return models


def ppo_step(rank: int, world: int, rollout, overrides=(), variant="full") -> dict:
    """One PPO step on this rank's contiguous shard of ``rollout``; returns what the test compares."""
    group = dist.group.WORLD if world > 1 else None
    rows = BATCH // world
    shard = rollout.select(slice(rank * rows, (rank + 1) * rows))
    if world == 1:  # the reference: one process, no strategy
        overrides = [o for o in overrides if not o.startswith("distributed.")]
    trainer = toy_trainer(
        *STEP_OVERRIDES,
        *overrides,
        *VARIANTS[variant],
        models=step_models(variant),
        generator=FixedRollouts(shard),
        group=group,
        rank=rank,
        world_size=world,
    )
    collected = {}
    update = trainer.update

    def keep(estimated, *args):  # the record the estimator made, on its way into the update
        collected["rollout"] = estimated
        return update(estimated, *args)

    trainer.update = keep
    metrics = reduce_metrics(trainer.step(), group)
    return {
        "advantages": collected["rollout"].advantages,
        "action_mask": collected["rollout"].action_mask,
        "metrics": metrics,
        # trained weights, whole (gathered from the shards under FSDP2)
        "policy": {
            k: full_tensor(p.detach()).clone()
            for k, p in trainer.policy.named_parameters()
            if p.requires_grad
        },
        "value_head": None
        if trainer.value_model is None
        else full_tensor(trainer.value_model.head.weight.detach()).clone(),
        "trained_state_bytes": trained_state_bytes(trainer.optimizer),
        # what an engine with its own weights receives: streamed one FSDP2 unit at a time, LoRA folded
        "engine_weights": {name: tensor.clone() for name, tensor in policy_weights(trainer.policy)},
    }


def _rank_worker(rank: int, world: int, port: int, rollout, results, overrides=(), variant="full") -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        results[rank] = ppo_step(rank, world, rollout, overrides, variant)
    finally:
        dist.destroy_process_group()


FSDP2 = "distributed.strategy=fsdp2"
TOKEN_BUDGET = ("ppo.micro_batch_size=null", "ppo.micro_batch_tokens=40")


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("overrides", "variant"),
    [
        ((), "full"),
        (TOKEN_BUDGET, "full"),  # moves rows between ranks to even out their tokens
        ((FSDP2,), "full"),
        ((FSDP2, *TOKEN_BUDGET), "full"),  # unequal micro-batch counts: padded to the same number
        ((FSDP2,), "lora"),
        ((FSDP2,), "shared"),
        # rows move between ranks after the groups' advantages are fixed; sequence means over all ranks' rows
        ((*TOKEN_BUDGET, "ppo.loss_aggregation=sequence_mean"), "rloo"),
        ((FSDP2,), "rloo"),
        ((FSDP2, *TOKEN_BUDGET), "episodes"),
    ],
    ids=[
        "ddp",
        "ddp-token-budget",
        "fsdp2",
        "fsdp2-token-budget",
        "fsdp2-lora",
        "fsdp2-shared-trunk",
        "ddp-token-budget-rloo-sequence-mean",
        "fsdp2-rloo",
        "fsdp2-token-budget-episodes",
    ],
)
def test_two_ranks_take_the_same_step_as_one_process(tmp_path, overrides, variant):
    rollout = fixed_episode_rollout(tmp_path) if variant == "episodes" else fixed_global_rollout(tmp_path)
    alone = ppo_step(0, 1, rollout, overrides, variant)
    with mp.Manager() as manager:
        results = manager.dict()
        port = 29500 + (os.getpid() + 7 * len(overrides) + 3 * len(variant)) % 1000  # a fresh port per case
        mp.spawn(_rank_worker, args=(2, port, rollout, results, overrides, variant), nprocs=2, join=True)
        ranks = [results[0], results[1]]

    # Advantages as one process computes them. GAE's are whitened with global mean and std over both
    # ranks' action tokens, no padding; the group baseline's are each group's own, whole on one rank.
    critic = variant != "rloo"  # a critic-free run logs no value metrics at all
    mask = alone["action_mask"].bool()
    together = torch.cat([r["advantages"] for r in ranks])
    torch.testing.assert_close(together[mask], alone["advantages"][mask], atol=1e-5, rtol=1e-5)
    assert together[mask].abs().max() > 0.01  # a signal to compare
    if critic:
        assert abs(together[mask].mean().item()) < 1e-5 and together[mask].std(
            unbiased=False
        ).item() == pytest.approx(1, abs=1e-4)
    # Losses and statistics: global token means, the same on both ranks and equal to one process's.
    assert all(
        (key in alone["metrics"]) == (critic or not key.startswith("value/")) for key in GLOBAL_METRICS
    )
    for key in (key for key in GLOBAL_METRICS if key in alone["metrics"]):
        assert ranks[0]["metrics"][key] == ranks[1]["metrics"][key], key
        assert ranks[0]["metrics"][key] == pytest.approx(alone["metrics"][key], rel=1e-4, abs=1e-6), key
    sharded = FSDP2 in overrides
    comm = ("perf/allgather_mb", "perf/reduce_scatter_mb") if sharded else ("perf/allreduce_mb",)
    for metric in comm:
        assert ranks[0]["metrics"][metric] > 0 and metric not in alone["metrics"], metric
    # Updated weights: identical on both ranks (gradients synced), equal to one process's.
    start = {k: p.detach() for k, p in step_models(variant).policy.named_parameters()}
    assert alone["policy"].keys() == ranks[0]["policy"].keys()
    for name, weight in alone["policy"].items():
        assert torch.equal(ranks[0]["policy"][name], ranks[1]["policy"][name]), name
        assert (weight - start[name]).abs().max().item() > 0, f"{name} did not train"
        torch.testing.assert_close(ranks[0]["policy"][name], weight, atol=1e-4 * 1e-2, rtol=0, msg=name)
    if critic:
        torch.testing.assert_close(ranks[0]["value_head"], alone["value_head"], atol=1e-6, rtol=0)
    # What training keeps (weights, gradients, Adam's moments): FSDP2 holds half of it on each of 2 ranks.
    held = ranks[0]["trained_state_bytes"] / alone["trained_state_bytes"]
    assert held == pytest.approx(0.5, abs=0.02) if sharded else held == 1.0
    # The weight stream an engine gets: whole on every rank, the same as one process's.
    for rank in ranks:
        assert rank["engine_weights"].keys() == alone["engine_weights"].keys()
        for name, weight in alone["engine_weights"].items():
            torch.testing.assert_close(rank["engine_weights"][name], weight, atol=1e-5, rtol=0, msg=name)


# --------------------------------------------------------------------------------------------------
# torchrun through the CLI
# --------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(
    ("strategy", "checkpoint"), [("ddp", "full"), ("fsdp2", "full"), ("fsdp2", "sharded")]
)
def test_torchrun_two_ranks_log_once_checkpoint_every_rank_and_resume_exactly(
    run_files, capsys, strategy, checkpoint
):
    straight = write_config(
        run_files,
        run={"steps": 4, "output_dir": str(run_files.parent / "straight")},
        distributed={"strategy": strategy, "checkpoint": checkpoint},
    )
    done = torchrun(str(straight))
    assert done.returncode == 0, done.stderr[-4000:]
    a = run_files.parent / "straight"
    start, *records = read_metrics(a)
    assert [r["step"] for r in [start, *records]] == [0, 1, 2, 3, 4]  # rank 0 logs; rank 1 does not
    assert start["preflight/samples"] == 8  # the pre-flight's samples of both ranks
    comm = "perf/reduce_scatter_mb" if strategy == "fsdp2" else "perf/allreduce_mb"
    assert all(r[comm] > 0 and math.isfinite(r["policy/loss"]) for r in records)
    final = AutoModelForCausalLM.from_pretrained(a / "final")  # plain transformers, whole weights
    saved = load_checkpoint(latest_checkpoint(a)).tensors
    if checkpoint == "sharded":  # each rank wrote its own half of every trained tensor
        assert {"policy-rank0", "policy-rank1", "optimizer-rank1"} <= saved.keys() and "policy" not in saved
        saved["policy"] = join_shards([saved["policy-rank0"], saved["policy-rank1"]])
    assert all(torch.equal(final.state_dict()[k], saved["policy"][k]) for k in saved["policy"])
    checkpoint = latest_checkpoint(a)
    assert json.loads((checkpoint / "manifest.json").read_text())["world_size"] == 2
    rng = load_file(checkpoint / "rng.safetensors")
    assert not torch.equal(rng["rank0/torch"], rng["rank1/torch"])  # each rank samples its own stream

    split = write_config(straight, run={"steps": 2, "output_dir": str(run_files.parent / "split")})
    assert torchrun(str(split)).returncode == 0
    done = torchrun("--resume", str(run_files.parent / "split"), "run.steps=4")
    assert done.returncode == 0, done.stderr[-4000:]
    b = run_files.parent / "split"
    assert comparable(read_metrics(a)) == comparable(read_metrics(b))
    saved_a, saved_b = (load_checkpoint(latest_checkpoint(d)).tensors for d in (a, b))
    assert saved_a.keys() == saved_b.keys()
    for group in saved_a.keys() - {"rng"}:
        assert saved_a[group].keys() == saved_b[group].keys() and all(
            torch.equal(saved_a[group][k], saved_b[group][k]) for k in saved_a[group]
        ), group

    # One process cannot continue a 2-rank run's sampling streams: refused unless explicitly allowed.
    # The checkpoint holds whole tensors under either strategy, so one process resumes an FSDP2 run too.
    shutil.copytree(b, run_files.parent / "alone")
    one_process = ("distributed.strategy=ddp", "distributed.checkpoint=full")  # a sharded one is put together
    alone = ("ppo", "--resume", str(run_files.parent / "alone"), "run.steps=5", *one_process)
    assert run_cli(*alone) == 2
    assert "world_size" in capsys.readouterr().err
    with pytest.warns(UserWarning, match="written by 2 ranks and this run has 1"):
        assert run_cli(*alone, "--allow-config-change") == 0
    assert [r["step"] for r in read_metrics(run_files.parent / "alone")] == [0, 1, 2, 3, 4, 5]


@pytest.mark.slow
@pytest.mark.distributed
def test_torchrun_fsdp2_with_lora_and_a_reward_model(run_files, make_reward_model, reward_tokenizer):
    """FSDP2 with a LoRA policy (its reference is the adapter-disabled view) and a learned reward model
    with its own tokenizer (sharded, gathered for scoring)."""
    rm_dir = run_files.parent / "rm"
    make_reward_model(reward_tokenizer).save_pretrained(rm_dir)
    reward_tokenizer.save_pretrained(rm_dir)
    config = write_config(
        run_files,
        models={"policy_lora": {"enabled": True, "r": 4}},
        reward={"model": {"path": str(rm_dir)}, "function": None},
        distributed={"strategy": "fsdp2"},
        data={"eval_prompts": str(run_files.parent / "prompts.jsonl"), "eval_judge": GOOD_JUDGE},
        run={"eval_every": 1},
    )
    done = torchrun(str(config))
    assert done.returncode == 0, done.stderr[-4000:]
    run = run_files.parent / "run"
    records = read_metrics(run)
    assert [r["step"] for r in records] == [0, 1, 2]  # step 0: the held-out evaluation of the start
    assert all(math.isfinite(r["reward/rm_score"]) and r["perf/allgather_mb"] > 0 for r in records[1:])
    # each rank evaluates its half of the held-out prompts (the policy, reference and RM gathered whole)
    assert all(math.isfinite(r["eval/gold_score"]) and math.isfinite(r["eval/kl/ref"]) for r in records)
    assert records[0]["eval/kl/ref"] == 0
    final = AutoModelForCausalLM.from_pretrained(run / "final")  # the adapter merged into whole weights
    base = AutoModelForCausalLM.from_pretrained(run_files.parent / "policy")
    moved = [k for k, w in final.state_dict().items() if not torch.equal(w, base.state_dict()[k])]
    assert moved and all("proj" in k for k in moved)  # LoRA's target modules changed, nothing else


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_a_lost_rank_ends_the_job_with_the_intact_checkpoint_and_resume_continues_exactly(
    run_files, strategy, monkeypatch
):
    """Rank 1 is SIGKILLed in the middle of step 3: rank 0 must not hang, must say which rank it lost
    and which checkpoint is intact, and ``--resume`` from it must give the run that was never killed."""
    marker = run_files.parent / "rank1-died"
    monkeypatch.setenv("LOST_RANK_MARKER", str(marker))

    def config(name):
        return write_config(
            run_files,
            reward={"function": LOSES_RANK1},
            run={"steps": 4, "checkpoint_every": 2, "output_dir": str(run_files.parent / name)},
            distributed={"strategy": strategy, "timeout_s": 30},
        )

    killed, never_killed = config("killed"), config("never-killed")
    started = time.monotonic()
    done = torchrun(str(killed))
    assert time.monotonic() - started < 60 and done.returncode != 0 and marker.exists()
    checkpoint = run_files.parent / "killed" / "checkpoints" / "step-000002"
    assert "rank 0 lost rank 1" in done.stderr and f"last intact checkpoint is {checkpoint}" in done.stderr
    assert "exitcode  : -9" in done.stderr  # torchrun's summary: rank 1 was killed
    assert [r["step"] for r in read_metrics(run_files.parent / "killed")] == [0, 1, 2]

    assert torchrun("--resume", str(run_files.parent / "killed")).returncode == 0
    assert torchrun(str(never_killed)).returncode == 0  # the marker exists: nobody dies this time
    resumed, straight = (read_metrics(run_files.parent / name) for name in ("killed", "never-killed"))
    assert [r["step"] for r in resumed] == [0, 1, 2, 3, 4] and comparable(resumed) == comparable(straight)


@pytest.mark.slow
@pytest.mark.distributed
def test_a_reward_function_failing_on_one_rank_is_reported_as_itself_not_as_a_lost_rank(run_files):
    config = write_config(run_files, reward={"function": FAILS_ON_RANK1}, distributed={"timeout_s": 30})
    done = torchrun(str(config))
    assert done.returncode != 0 and "exitcode  : 2" in done.stderr, done.stderr  # both ranks: bad input
    assert "on rank 1:" in done.stderr and "rank 1's reward service is down" in done.stderr
    assert "lost rank" not in done.stderr


def _dynamic_sampling_worker(rank: int, world: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        trainer = toy_trainer(
            *DYNAMIC_SAMPLING,
            models=scored_by(signal_on_cats),
            group=dist.group.WORLD,
            rank=rank,
            world_size=world,
        )
        rollout = trainer.sampler.sample(trainer.policy_version, {})
        results[rank] = (len(rollout), dict(trainer.sampler.metrics), rollout.prompts)
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_dynamic_sampling_ranks_sample_in_step_and_count_globally():
    """Each rank fills its own share with groups that have a signal; they take the same number of extra
    rounds (a rank already full samples along, so the collectives of generation match) and log global
    counts."""
    with mp.Manager() as manager:
        results = manager.dict()
        port = 29500 + (os.getpid() + 11) % 1000
        mp.spawn(_dynamic_sampling_worker, args=(2, port, results), nprocs=2, join=True)
        ranks = [results[0], results[1]]
    assert [rows for rows, _, _ in ranks] == [8, 8]  # each rank's share of 8 prompts x 2 samples
    assert ranks[0][1] == ranks[1][1] and ranks[0][1]["rollout/flat_groups_kept"] == 0
    rounds = 1 + ranks[0][1]["rollout/extra_rounds"]
    assert ranks[0][1]["rollout/signal_groups"] + ranks[0][1]["rollout/flat_groups_dropped"] == 8 * rounds
    assert all("cat" in str(p) or "happy" in str(p) for _, _, prompts in ranks for p in prompts)
