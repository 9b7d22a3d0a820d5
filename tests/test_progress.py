"""The console of a run: stages from the first second, step lines that fit 80 columns, silence elsewhere."""

import math
import re
import threading
import time

from lmppo.progress import WIDTH, BatchLines, ProgressDisplay, advance, duration, phase

STEP_METRICS = {
    "reward/rm_score": 0.5,
    "kl/ref": 1.25,
    "kl/beta": 0.05,
    "policy/clip_frac": 0.1,
    "perf/step_s": 2.0,
}


def test_quiet_progress_prints_the_stages_before_step_1_then_a_step_line_every_n_steps(capsys):
    with ProgressDisplay(10, quiet=True, every=4) as progress:
        with phase("loading the policy sft (512.0 MiB)"):
            advance("token", 3, 8)  # counters are for the live display only
        progress.begin_steps(0)
        for step in range(1, 11):
            with phase(f"step {step}/10"), phase("update"):
                progress.update(step, STEP_METRICS)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "loading the policy sft (512.0 MiB)"
    assert [line.split("  ")[0] for line in lines[1:]] == ["step 4/10", "step 8/10", "step 10/10"]
    assert re.fullmatch(r"step 4/10  reward 0.5  kl 1.2  clip 0.1  2s/step  ETA \d.*s", lines[1])


def test_progress_measures_step_time_and_eta_when_not_given(monkeypatch):
    clock = iter([1000.0, 1030.0])  # 30 s for the 10 steps since the resumed run started
    monkeypatch.setattr(time, "perf_counter", lambda: next(clock))
    progress = ProgressDisplay(100, quiet=True, start_step=40, reward_label="rm")
    line = progress.status_line(50, {"kl/ref": 2.0, "policy/clip_frac": math.nan})
    assert line == "step 50/100  kl 2  clip nan  3s/step  ETA 2m30s"


def test_the_step_line_fits_80_columns_at_its_widest(monkeypatch):
    monkeypatch.setattr(time, "perf_counter", iter([0.0, 20 * 86400.0]).__next__)  # 20 days to step 1
    progress = ProgressDisplay(10_000, quiet=True)
    widest = {
        "reward/rm_score": -1.23456789e-05,
        "kl/ref": -1.23456e-05,
        "policy/clip_frac": 0.123456,
        "perf/step_s": 86399.0,
    }
    assert len(progress.status_line(9_999, widest)) <= WIDTH


def test_durations_take_a_few_characters():
    shown = [duration(s) for s in (0.0123, 8.44, 9.96, 59.4, 754, 3599.4, 11_100, 86_399, 190_000, 9e6)]
    assert shown == [
        "0.012s",
        "8.4s",
        "10s",
        "59s",
        "12m34s",
        "59m59s",
        "3h05m",
        "23h59m",
        "2d04h",
        "104d04h",
    ]


def test_the_live_display_shows_the_current_stage_and_its_counters_then_the_last_step(capsys):
    progress = ProgressDisplay(3)
    progress.quiet = False  # pytest's stdout is not a terminal, which would select quiet mode
    with progress:
        progress.begin_steps(0)
        with phase("step 1/3"), phase("generating"):
            advance("token", 7, 32)
            assert progress.stage == "step 1/3 · generating · token 7/32"
        assert progress.stage == ""
        for step in (1, 2, 3):
            progress.update(step, STEP_METRICS)
    assert "step 3/3  reward 0.5" in capsys.readouterr().out


def test_stages_are_silent_without_a_display_on_other_ranks_and_off_the_main_thread(capsys):
    with phase("no display is open"):
        advance("token", 1, 2)
    with ProgressDisplay(2, quiet=True, every=1, enabled=False) as progress:  # another rank's
        with phase("rank 1 loads"):
            progress.update(1, STEP_METRICS)
    with ProgressDisplay(2, quiet=True):
        worker = threading.Thread(target=lambda: phase("the rollout worker").__enter__())
        worker.start()
        worker.join()
    assert capsys.readouterr().out == ""


def test_a_supervised_stage_shows_its_epochs_and_steps_without_a_ppo_step_line(capsys):
    progress = ProgressDisplay(0)  # lmppo sft / train-rm: stages only
    progress.quiet = False
    with progress, phase("epoch 1/2"):
        advance("step", 3, 40)
        assert progress.stage == "epoch 1/2 · step 3/40"
    assert "step 0/0" not in capsys.readouterr().out
    with ProgressDisplay(0, quiet=True), phase("epoch 2/2"):  # a log file: a line per epoch
        advance("step", 21, 40)
    assert capsys.readouterr().out == "epoch 2/2\n"


def test_in_an_episode_the_step_line_shows_the_reward_the_run_optimises_with_its_parts():
    progress = ProgressDisplay(10, quiet=True, reward_label="rm")
    episode = {**STEP_METRICS, "reward/turn": 0.25, "reward/total": 0.75}
    assert progress.status_line(1, episode).startswith(
        "step 1/10  reward 0.75 (final 0.5, turn 0.25)  kl 1.2"
    )
    environment_only = {**episode, "reward/rm_score": 0.0, "reward/total": 0.25}
    assert progress.status_line(1, environment_only).startswith("step 1/10  reward 0.25  kl 1.2")
    assert progress.status_line(1, STEP_METRICS).startswith(
        "step 1/10  rm 0.5  kl 1.2"
    )  # no episode: as ever


def test_batch_lines_print_whatever_stdout_is_with_the_loss_and_an_eta(capsys):
    lines = BatchLines("SFT", 40, every_s=3600.0)
    for done in range(1, 41):
        lines.batch(done, 1.0 / done)
    printed = capsys.readouterr().out.splitlines()
    assert [line.split("  ")[0] for line in printed] == [
        f"SFT: batch {k}/40" for k in (1, 4, 8, *range(12, 41, 4))
    ]
    assert re.fullmatch(r"SFT: batch 40/40  loss 0.025  \S+s elapsed  ETA 0s", printed[-1])
    with ProgressDisplay(0, quiet=True), phase("epoch 1/1"):  # quiet: the stage, then the batches
        BatchLines("SFT", 2).batch(1, 0.5)
    assert capsys.readouterr().out.splitlines()[1].startswith("SFT: batch 1/2  loss 0.5  ")
