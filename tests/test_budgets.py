"""Out-of-memory recovery (lmppo.training.budgets): a phase that runs out halves its token budget and is
redone, the run keeps the budget (also across resume), and a phase out of halvings stops the run with
the remedies. The errors are raised on purpose from a chosen forward."""

import functools

import pytest
import torch
from helpers import comparable, run_cli, toy_trainer, write_config

from lmppo.runs.checkpoint import latest_checkpoint, load_checkpoint
from lmppo.sampling.hf_engine import DecodeLoop
from lmppo.sampling.responses import ResponseGenerator
from lmppo.training import scorer
from lmppo.training.budgets import OutOfMemory, TokenBudgets, out_of_memory_error
from lmppo.training.metrics import read_metrics
from lmppo.training.trainer import PPOTrainer


def running_out(function, on_calls: set[int]):
    """``function``, raising torch.OutOfMemoryError instead on its calls numbered in ``on_calls`` (from 1)."""
    calls = [0]

    @functools.wraps(function)
    def wrapped(*args, **kwargs):
        calls[0] += 1
        if calls[0] in on_calls:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (on purpose)")
        return function(*args, **kwargs)

    return wrapped


def test_a_phase_that_runs_out_is_redone_under_half_the_tokens_and_stops_after_the_limit():
    budgets, seen = TokenBudgets(None, None, 300), []

    def forward(budget):
        seen.append(budget)
        if len(seen) < 3:
            raise torch.OutOfMemoryError("out of memory")
        return "done"

    with pytest.warns(UserWarning, match=r"ppo\.micro_batch_tokens=100 .* rest of the run"):
        assert budgets.shrinking("update", forward, lambda: 200, limit=4) == "done"
    assert seen == [300, 100, 50]  # the unit that failed (200 < 300) is what halves
    assert budgets.metrics() == {"perf/oom_retries": 2.0, "perf/micro_batch_tokens": 50.0}
    assert budgets.metrics()["perf/oom_retries"] == 0.0  # a step's count
    restored = TokenBudgets(None, None, None)
    restored.load_state_dict(budgets.state_dict())
    assert restored.update == 50 and restored.halvings == {"update": 2}

    def never(budget):
        raise torch.OutOfMemoryError("out of memory")

    with pytest.warns(UserWarning), pytest.raises(OutOfMemory, match=r"halved 4 times .* to 12 tokens"):
        budgets.shrinking("update", never, lambda: 50, limit=4)


def test_an_update_that_runs_out_equals_one_started_with_the_smaller_budget(monkeypatch):
    recovered = toy_trainer("ppo.minibatch_size=8", "ppo.ppo_epochs=1")
    monkeypatch.setattr(recovered, "micro_batch_loss", running_out(recovered.micro_batch_loss, {1}))
    with pytest.warns(UserWarning, match="out of memory in the update"):
        first = recovered.step()
    budget = recovered.budgets.update
    assert first["perf/oom_retries"] == 1 and first["perf/micro_batch_tokens"] == budget
    assert recovered.step()["perf/oom_retries"] == 0 and recovered.budgets.update == budget

    started_small = toy_trainer(
        "ppo.minibatch_size=8", "ppo.ppo_epochs=1", f"ppo.micro_batch_tokens={budget}"
    )
    for _ in range(2):
        started_small.step()
    for a, b in zip(recovered.policy.parameters(), started_small.policy.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # only the accumulation's order differs


def test_a_stored_pass_and_generation_that_run_out_are_redone_in_smaller_forwards(monkeypatch):
    plain = toy_trainer("ppo.ppo_epochs=1")
    expected = plain.step()
    trainer = toy_trainer("ppo.ppo_epochs=1")
    monkeypatch.setattr(DecodeLoop, "_decode_loop", running_out(DecodeLoop._decode_loop, {1}))
    monkeypatch.setattr(
        scorer, "sequence_logprobs", running_out(scorer.sequence_logprobs, {1})
    )  # the reference's
    with pytest.warns(UserWarning, match="out of memory"):
        metrics = trainer.step()
    assert metrics["perf/oom_retries"] == 2
    assert trainer.budgets.generation and trainer.budgets.stored_passes
    # the first decode ran out before drawing a token: the smaller batches draw the same samples
    assert metrics["response/length"] == expected["response/length"]
    torch.testing.assert_close(metrics["kl/ref"], expected["kl/ref"], rtol=1e-4, atol=1e-6)


class OwnBatchesEngine:
    """An engine that batches by itself, as vLLM does (no decode budget to halve), and runs out of memory."""

    decode_budget, owns_weights, device = None, True, torch.device("cpu")
    memory_remedy = "a smaller rollout.vllm_kv_cache_gb (on purpose)"

    def __init__(self, loop: DecodeLoop) -> None:
        self.settings, self.pad_token_id = loop.settings, loop.pad_token_id
        self.calls = 0

    def sample(self, *args, **kwargs):
        self.calls += 1
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (on purpose)")


def test_generation_on_an_engine_with_its_own_batches_stops_with_what_that_engine_can_do():
    """No decode budget to halve (vLLM): generation is not redone, no budget is touched, and the error says
    what frees memory for that engine, not to halve rollout.generation_batch_tokens."""
    trainer = toy_trainer()
    loop = trainer.generator
    engine = OwnBatchesEngine(loop.engine)
    trainer = toy_trainer(generator=ResponseGenerator(engine, loop.renderer))
    with pytest.raises(
        OutOfMemory, match=r"out of memory in generation .*on purpose.*: a smaller rollout\.vllm"
    ):
        trainer.step()
    assert engine.calls == 1 and trainer.budgets.generation is None and not trainer.budgets.halvings


def test_resume_after_a_recovery_keeps_the_budget_and_is_exact(run_files, monkeypatch):
    micro_batch_loss = PPOTrainer.micro_batch_loss

    def out_of_memory_in_the_first_update():
        monkeypatch.setattr(PPOTrainer, "micro_batch_loss", running_out(micro_batch_loss, {1}))

    straight = write_config(run_files, run={"steps": 4, "output_dir": str(run_files.parent / "straight")})
    out_of_memory_in_the_first_update()
    with pytest.warns(UserWarning, match="out of memory in the update"):
        assert run_cli("ppo", str(straight)) == 0
    split = write_config(straight, run={"steps": 2, "output_dir": str(run_files.parent / "split")})
    out_of_memory_in_the_first_update()
    with pytest.warns(UserWarning, match="out of memory in the update"):
        assert run_cli("ppo", str(split)) == 0
    state = load_checkpoint(latest_checkpoint(run_files.parent / "split")).state
    assert state["token_budgets"]["update"] and state["token_budgets"]["halvings"] == {"update": 1}
    assert run_cli("ppo", "--resume", str(run_files.parent / "split"), "run.steps=4") == 0
    a, b = (read_metrics(run_files.parent / name) for name in ("straight", "split"))
    assert comparable(a) == comparable(b)
    assert [r.get("perf/micro_batch_tokens") for r in a] == [r.get("perf/micro_batch_tokens") for r in b]


def test_a_phase_out_of_halvings_stops_the_run_naming_the_budget_and_the_remedies(
    run_files, monkeypatch, capsys
):
    monkeypatch.setattr(
        PPOTrainer, "micro_batch_loss", running_out(PPOTrainer.micro_batch_loss, set(range(1, 99)))
    )
    with pytest.warns(UserWarning):
        assert run_cli("ppo", str(run_files), "run.oom_retries=2") == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "out of memory in the update after ppo.micro_batch_tokens was halved 2 times" in err
    assert "remedies" in err and "step-000000" in err and "Traceback" not in err


def test_an_error_no_phase_can_redo_names_half_the_budgets_to_set():
    err = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    message = str(out_of_memory_error(err, TokenBudgets(None, 1024, 400), world_size=2))
    assert "2 ranks cannot redo a phase" in message and "Tried to allocate 2.00 GiB" in message
    assert "rollout.forward_batch_tokens=512, ppo.micro_batch_tokens=200" in message
    unset = str(out_of_memory_error(err, TokenBudgets(None, None, None), world_size=1))
    assert "set the token budgets rollout.generation_batch_tokens" in unset
