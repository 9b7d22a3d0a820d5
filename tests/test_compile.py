"""run.compile (lmppo.modeling.compile): compiled decoder layers give the eager passes' numbers within
fp32 rounding, the decode loop stays eager, a run's graphs stay few, and a compiled run resumes exactly."""

import pytest
import torch
import yaml
from helpers import comparable, run_cli, toy_trainer, write_config

from lmppo.modeling.compile import compiled_graphs
from lmppo.runs.checkpoint import latest_checkpoint, load_checkpoint
from lmppo.sampling.passes import sequence_logprobs, value_predictions
from lmppo.training.metrics import read_metrics

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:torch")  # inductor's notes on this CPU

TOLERANCE = dict(atol=1e-5, rtol=1e-5)  # fp32: fused kernels round in another order


def test_compiled_passes_equal_the_eager_ones_and_the_decode_loop_stays_eager():
    eager, compiled = toy_trainer(), toy_trainer("run.compile=true")
    rollout = eager.sampler.generate(eager.policy_version)
    before = compiled_graphs()
    compiled.sampler.generate(compiled.policy_version)
    assert compiled_graphs() == before  # generating compiled nothing

    logp, entropy, values = eager.train_module(rollout)
    logp_c, entropy_c, values_c = compiled.train_module(rollout)
    assert compiled_graphs() > before  # the update's forward compiled
    for a, b in [(logp, logp_c), (entropy, entropy_c), (values, values_c)]:
        torch.testing.assert_close(b, a, **TOLERANCE)
    (logp.sum() + values.sum()).backward()
    (logp_c.sum() + values_c.sum()).backward()
    for p, q in zip(eager.policy.parameters(), compiled.policy.parameters(), strict=True):
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(
        sequence_logprobs(compiled.models.reference, rollout),
        sequence_logprobs(eager.models.reference, rollout),
        **TOLERANCE,
    )
    torch.testing.assert_close(
        value_predictions(compiled.value_model, rollout)[0],
        value_predictions(eager.value_model, rollout)[0],
        **TOLERANCE,
    )


def test_a_compiled_run_steps_like_an_eager_one_on_few_graphs(recwarn):
    eager, compiled = toy_trainer(), toy_trainer("run.compile=true")
    for step in range(4):  # rollouts of other lengths each step: the shapes are symbolic
        torch.manual_seed(step)  # both sample the same responses
        expected = eager.step()
        torch.manual_seed(step)
        metrics = compiled.step()
        for key in ("policy/loss", "value/loss", "kl/ref", "reward/rm_score"):
            assert metrics[key] == pytest.approx(expected[key], rel=1e-4, abs=1e-5), (step, key)
    assert metrics["perf/compiles"] <= 6  # update (forward, backward), stored passes: not one per shape
    assert not [w for w in recwarn if "more graph" in str(w.message)]


@pytest.mark.slow
def test_a_compiled_run_resumes_exactly(run_files):
    models = yaml.safe_load(run_files.read_text())["models"]
    straight = write_config(
        run_files, models=models, run={"steps": 3, "compile": True, "output_dir": str(run_files.parent / "a")}
    )
    assert run_cli("ppo", str(straight)) == 0
    split = write_config(straight, run={"steps": 1, "output_dir": str(run_files.parent / "b")})
    assert run_cli("ppo", str(split)) == 0
    assert run_cli("ppo", "--resume", str(run_files.parent / "b"), "run.steps=3") == 0
    a, b = (run_files.parent / name for name in "ab")
    assert comparable(read_metrics(a)) == comparable(read_metrics(b))
    weights_a, weights_b = (load_checkpoint(latest_checkpoint(d)).tensors["policy"] for d in (a, b))
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)
