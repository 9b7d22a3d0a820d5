"""The command line: a run through `lmppo ppo`, and user errors as one paragraph with exit code 2."""

import math
import subprocess
import sys

import pytest
from helpers import run_cli

from lmppo.inputs.config import load_config
from lmppo.training.metrics import read_metrics


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


# `lmppo ARGS` in a fresh interpreter; its last line names the heavy modules it imported.
LMPPO_THEN_HEAVY_MODULES = """
import sys
from lmppo.interface.cli import main
sys.argv = ["lmppo", *sys.argv[1:]]
try:
    main()
finally:
    print("imported:", sorted({"torch", "transformers"} & set(sys.modules)))
"""


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--help"], "Usage: lmppo"),
        (["ppo", "--help"], "Usage: lmppo ppo"),
        (["ppo", "missing.yaml"], "config file missing.yaml does not exist"),
        (["ppo", "bad.yaml"], "unknown key 'ppo.lrr': did you mean 'ppo.lr'?"),
        (["plan", "missing.yaml"], "config file missing.yaml does not exist"),
        (["report", "missing_dir"], "no missing_dir/metrics.jsonl: train first"),
        (["diagnose", "missing_dir"], "no missing_dir/metrics.jsonl: train first"),
    ],
)
def test_help_and_errors_a_config_or_a_missing_file_causes_import_neither_torch_nor_transformers(
    tmp_path, args, expected
):
    (tmp_path / "bad.yaml").write_text("ppo:\n  lrr: 1\n")
    done = subprocess.run(
        [sys.executable, "-c", LMPPO_THEN_HEAVY_MODULES, *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = " ".join((done.stdout + done.stderr).split())  # the console wraps long lines
    assert expected in output and "Traceback" not in output, output
    assert done.stdout.splitlines()[-1] == "imported: []"


def test_verbose_leaves_transformers_progress_bars_and_logs_on(tmp_path, capsys, monkeypatch):
    from transformers.utils import logging as transformers_logging

    monkeypatch.delenv("TRANSFORMERS_VERBOSITY", raising=False)
    transformers_logging.enable_progress_bar()  # as a fresh process starts
    transformers_logging.set_verbosity_warning()
    nowhere = str(tmp_path / "nowhere")  # serve-rm gets as far as loading the model, which fails at once
    assert run_cli("--verbose", "serve-rm", nowhere) == 2
    assert transformers_logging.is_progress_bar_enabled()
    assert transformers_logging.get_verbosity() == transformers_logging.WARNING
    assert run_cli("serve-rm", nowhere) == 2  # by default quiet, from the moment a command loads models
    assert not transformers_logging.is_progress_bar_enabled()
    assert transformers_logging.get_verbosity() == transformers_logging.ERROR
    assert capsys.readouterr().err.count("never downloads") == 2
