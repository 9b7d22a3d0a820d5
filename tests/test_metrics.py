import json
import math
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lmppo.errors import LmppoError
from lmppo.training.metrics import (
    METRIC_NAMES,
    REDUCE_OPS,
    RENAMED_METRICS,
    MetricsLogger,
    read_metrics,
    reduce_metrics,
)

DOCS = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"


def _strict_json(line):
    def refuse(constant):
        raise ValueError(f"non-standard JSON constant {constant}")

    return json.loads(line, parse_constant=refuse)


def test_every_metric_is_described_here_and_in_the_docs():
    docs = DOCS.read_text()
    for name, description in METRIC_NAMES.items():
        assert description.strip(), name
        assert f"`{name}`" in docs, f"docs/metrics.md does not document {name}"
    assert set(REDUCE_OPS) <= set(METRIC_NAMES)
    assert set(REDUCE_OPS.values()) <= {"mean", "sum", "max", "min"}
    assert set(RENAMED_METRICS.values()) <= set(METRIC_NAMES) and not set(RENAMED_METRICS) & set(METRIC_NAMES)
    for old, new in RENAMED_METRICS.items():
        assert f"`{old}`" in docs and f"`{new}`" in docs, f"docs/metrics.md's renamed table lacks {old}"


def test_a_metrics_file_written_before_a_rename_reads_under_the_new_names(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(
        json.dumps({"step": 1, "time": 0.0, "health/grad_norm": 0.5, "eval/kl_ref": 2.0, "kl/ref": 1.0})
        + "\n"
    )
    (record,) = read_metrics(tmp_path)
    assert record == {"step": 1, "time": 0.0, "policy/grad_norm": 0.5, "eval/kl/ref": 2.0, "kl/ref": 1.0}


# --------------------------------------------------------------------------------------------------
# reduce_metrics
# --------------------------------------------------------------------------------------------------


def test_reduce_without_a_group_returns_plain_floats():
    reduced = reduce_metrics({"kl/ref": torch.tensor(2.5), "response/length": np.int64(7)})
    assert reduced == {"kl/ref": 2.5, "response/length": 7.0}
    assert all(type(v) is float for v in reduced.values())


def _reduce_on_rank(rank, store, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        metrics = {
            "kl/ref": 1.0 + rank,  # mean -> 1.5
            "policy/ratio_max": [1.5, 3.0][rank],  # max -> 3.0
            "perf/rollout_tokens_per_s": 100.0 * (rank + 1),  # min (the slowest rank) -> 100
            "health/nonfinite": float(rank),  # max -> 1
            "adv/std": [0.5, math.nan][rank],  # a NaN anywhere stays visible
        }
        result = {
            "default": reduce_metrics(metrics, group=dist.group.WORLD),
            "sum": reduce_metrics({"custom/count": 2.0 + rank}, group=dist.group.WORLD, op="sum"),
        }
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_reduce_over_two_gloo_ranks_uses_each_metrics_op(tmp_path):
    mp.spawn(_reduce_on_rank, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for result in results:
        default = result["default"]
        assert default["kl/ref"] == 1.5
        assert default["policy/ratio_max"] == 3.0
        assert default["perf/rollout_tokens_per_s"] == 100.0
        assert default["health/nonfinite"] == 1.0
        assert math.isnan(default["adv/std"])
        assert result["sum"] == {"custom/count": 5.0}


# --------------------------------------------------------------------------------------------------
# MetricsLogger / read_metrics
# --------------------------------------------------------------------------------------------------


def test_jsonl_holds_one_valid_record_per_step_flushed_as_it_goes(tmp_path):
    logger = MetricsLogger(tmp_path)
    logger.log(1, {"kl/ref": torch.tensor(0.25), "response/length": 12, "adv/mean": np.float32(0.5)})
    logger.log(2, {"kl/ref": math.nan, "value/loss": math.inf, "adv/mean": -math.inf})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()  # before close: flushed each step
    records = [_strict_json(line) for line in lines]
    assert [r["step"] for r in records] == [1, 2]
    assert records[0]["kl/ref"] == 0.25 and records[0]["response/length"] == 12.0
    assert records[1]["kl/ref"] == "NaN" and records[1]["value/loss"] == "Infinity"
    assert records[1]["adv/mean"] == "-Infinity"
    assert all(isinstance(r["time"], float) for r in records)
    logger.close()

    read = read_metrics(tmp_path)
    assert read[0]["kl/ref"] == 0.25
    assert (
        math.isnan(read[1]["kl/ref"])
        and read[1]["value/loss"] == math.inf
        and read[1]["adv/mean"] == -math.inf
    )


def test_only_the_main_process_writes(tmp_path):
    with MetricsLogger(tmp_path / "run", is_main_process=False) as logger:
        logger.log(1, {"kl/ref": 1.0})
    assert not (tmp_path / "run").exists()


def test_reserved_keys_are_refused(tmp_path):
    with MetricsLogger(tmp_path) as logger, pytest.raises(ValueError, match="reserved"):
        logger.log(1, {"step": 3.0})


def test_resuming_drops_steps_after_the_checkpoint_and_a_torn_last_line(tmp_path):
    with MetricsLogger(tmp_path) as logger:
        for step in range(1, 6):
            logger.log(step, {"kl/ref": float(step)})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "kl/r')  # the process died mid-write
    with MetricsLogger(tmp_path, resume_step=3) as logger:
        logger.log(4, {"kl/ref": 40.0})
    assert [(r["step"], r["kl/ref"]) for r in read_metrics(tmp_path)] == [
        (1, 1.0),
        (2, 2.0),
        (3, 3.0),
        (4, 40.0),
    ]

    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "kl')
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4]  # a torn last line is skipped
    with MetricsLogger(tmp_path) as logger:  # and dropped by the next writer
        logger.log(5, {"kl/ref": 5.0})
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4, 5]


def test_a_damaged_line_in_the_middle_is_an_error(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"ste\n{"step": 3}\n')
    with pytest.raises(LmppoError, match="line 2"):
        read_metrics(tmp_path)
    with pytest.raises(LmppoError, match="no metrics"):
        read_metrics(tmp_path / "elsewhere")


def test_a_tracker_sink_without_its_package_says_which_extra_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` fail
    with pytest.raises(LmppoError, match=r"'wandb'.*pip install 'lmppo\[tracking\]'"):
        MetricsLogger(tmp_path, sinks=["jsonl", "wandb"])
    with pytest.raises(LmppoError, match="unknown logging sink"):
        MetricsLogger(tmp_path, sinks=["jsonl", "neptune"])


def test_the_wandb_sink_gets_config_and_every_step_and_a_resume_continues_its_run(tmp_path, monkeypatch):
    calls = []
    run = types.SimpleNamespace(
        id="w123",
        log=lambda metrics, step: calls.append(("log", step, metrics)),
        finish=lambda: calls.append(("finish",)),
    )

    def init(**kwargs):
        calls.append(("init", kwargs))
        return run

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    with MetricsLogger(
        tmp_path, sinks=["jsonl", "wandb"], run_name="r1", config={"ppo": {"lr": 1e-5}}
    ) as logger:
        logger.log(3, {"kl/ref": 0.5})
    started = {"project": "lmppo", "name": "r1", "config": {"ppo": {"lr": 1e-5}}, "dir": str(tmp_path)}
    assert calls == [("init", started), ("log", 3, {"kl/ref": 0.5}), ("finish",)]
    assert read_metrics(tmp_path)[0]["kl/ref"] == 0.5  # JSONL is written alongside
    calls.clear()
    with MetricsLogger(tmp_path, sinks=["wandb"], run_name="r1", config={}, resume_step=3) as logger:
        logger.log(4, {"kl/ref": 0.6})
    assert calls[0] == ("init", {**started, "config": {}, "id": "w123", "resume": "must"})


def test_the_mlflow_sink_gets_config_and_every_step_and_a_resume_continues_its_run(tmp_path, monkeypatch):
    calls = []

    def start_run(**kwargs):
        calls.append(("start", kwargs))
        return types.SimpleNamespace(info=types.SimpleNamespace(run_id="m456"))

    fake = types.SimpleNamespace(
        start_run=start_run,
        log_dict=lambda config, name: calls.append(("config", name, config)),
        log_metrics=lambda metrics, step: calls.append(("log", step, metrics)),
        end_run=lambda: calls.append(("end",)),
    )
    monkeypatch.setitem(sys.modules, "mlflow", fake)
    with MetricsLogger(tmp_path, sinks=["mlflow"], run_name="r2", config={"kl": {"beta": 0.1}}) as logger:
        logger.log(7, {"kl/ref": 1.5})
    assert calls == [
        ("start", {"run_name": "r2"}),
        ("config", "config.json", {"kl": {"beta": 0.1}}),
        ("log", 7, {"kl/ref": 1.5}),
        ("end",),
    ]
    calls.clear()
    with MetricsLogger(tmp_path, sinks=["mlflow"], run_name="r2", resume_step=7) as logger:
        logger.log(8, {"kl/ref": 1.6})
    assert calls == [("start", {"run_id": "m456"}), ("log", 8, {"kl/ref": 1.6}), ("end",)]


def test_the_tensorboard_sink_writes_every_step_as_a_scalar_and_the_config_as_text(tmp_path):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    steps = {
        1: {"kl/ref": 0.1, "policy/loss": -1.5},
        2: {"kl/ref": math.nan, "policy/loss": math.inf},  # kept as logged, like the JSONL
        5: {"kl/ref": 0.3, "policy/loss": -math.inf},
    }
    config = {"ppo": {"lr": 1e-5}}
    with MetricsLogger(tmp_path, sinks=["jsonl", "tensorboard"], config=config) as logger:
        for step, metrics in steps.items():
            logger.log(step, metrics)

    events = event_accumulator.EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["kl/ref", "policy/loss"]
    for name in ("kl/ref", "policy/loss"):
        scalars = events.Scalars(name)
        assert [e.step for e in scalars] == list(steps)
        logged = [metrics[name] for metrics in steps.values()]
        assert [e.value for e in scalars] == pytest.approx(logged, rel=1e-6, nan_ok=True)  # float32
    (text,) = events.Tensors("config/text_summary")
    assert json.loads(text.tensor_proto.string_val[0].decode().strip("`\n")) == config


def test_a_resumed_run_drops_the_tensorboard_steps_logged_after_its_checkpoint(tmp_path):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    with MetricsLogger(tmp_path, sinks=["tensorboard"]) as logger:
        for step in range(1, 6):
            logger.log(step, {"kl/ref": float(step)})
    with MetricsLogger(tmp_path, sinks=["tensorboard"], resume_step=3) as logger:  # the checkpoint was step 3
        for step in (4, 5):
            logger.log(step, {"kl/ref": 10.0 * step})
    events = event_accumulator.EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("kl/ref")] == [(1, 1), (2, 2), (3, 3), (4, 40), (5, 50)]
