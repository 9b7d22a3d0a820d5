"""The command line: a run through `lmppo ppo`, and user errors as one paragraph with exit code 2."""

import math

from helpers import run_cli

from lmppo.config import load_config
from lmppo.metrics import read_metrics


def test_two_step_run_through_the_cli(run_files):
    assert run_cli("ppo", str(run_files)) == 0
    run_dir = run_files.parent / "run"
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [0, 1, 2]  # step 0: the reward pre-flight of the start
    for key in (
        "reward/rm_score",
        "reward/kl_penalty",
        "reward/shaped",
        "kl/ref",
        "policy/clip_frac",
        "value/explained_var",
        "response/eos_frac",
        "perf/step_s",
    ):
        assert all(math.isfinite(r[key]) for r in records[1:]), key
    assert "preflight/rm_score_mean" in records[0] and (run_dir / "preflight.json").is_file()
    assert (run_dir / "config.yaml").is_file() and load_config(run_dir / "config.yaml").run.steps == 2
    assert (run_dir / "final" / "config.json").is_file() and (
        run_dir / "final" / "generation_config.json"
    ).is_file()
    card = (run_dir / "final" / "README.md").read_text()
    assert "count_good" in card and "beta" in card
    # Running again into the same directory without --resume would mix two runs: refused.
    assert run_cli("ppo", str(run_files)) == 2


def test_cli_config_errors_exit_2_without_traceback(run_files, capsys):
    assert run_cli("ppo", str(run_files), "ppo.lrr=1") == 2
    err = capsys.readouterr().err
    assert "did you mean 'ppo.lr'" in err and "Traceback" not in err


def test_transformers_progress_bars_and_load_reports_stay_out_of_the_console(run_files, capsys, monkeypatch):
    from transformers.utils import logging as transformers_logging

    monkeypatch.delenv("TRANSFORMERS_VERBOSITY", raising=False)
    transformers_logging.enable_progress_bar()  # as a fresh process starts
    transformers_logging.set_verbosity_warning()
    assert run_cli("ppo", str(run_files)) == 0
    err = capsys.readouterr().err
    assert "Loading weights" not in err and "Writing model shards" not in err and "LOAD REPORT" not in err
    assert not transformers_logging.is_progress_bar_enabled()
