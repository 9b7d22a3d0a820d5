import base64
import json
import math
import re
from pathlib import Path

import pytest

from lmppo.errors import LmppoError
from lmppo.runs.evaluate import EVAL_FILE, EvalResult, write_eval_json
from lmppo.runs.report import CONFIG_FILE, Panel, _response_cell, report, score_curves
from lmppo.training.metrics import MetricsLogger
from lmppo.training.reward_modeling import RM_EVAL_FILE, write_rm_eval_json

STEPS = 6


def write_metrics(run_dir: Path, names: list[str], hacking: bool = False) -> None:
    with MetricsLogger(run_dir) as logger:
        for step in range(1, STEPS + 1):
            values = {name: 0.1 * step for name in names}
            if "eval/gold_score" in names:
                values["eval/gold_score"] = (-0.2 if hacking else 0.1) * step
                if step % 2:
                    values = {
                        k: v for k, v in values.items() if not k.startswith("eval/")
                    }  # eval every 2 steps
            logger.log(step, values)


ALL_CURVES = [
    "reward/rm_score", "eval/reward/rm_score", "eval/gold_score", "eval/demo_ppl", "kl/ref", "eval/kl/ref", "kl/beta",
    "policy/loss", "policy/clip_frac", "value/clip_frac", "policy/entropy", "policy/approx_kl", "value/loss",
    "value/explained_var", "response/length", "eval/response/length", "response/eos_frac", "eval/response/eos_frac",
]  # fmt: skip


def summary(accuracy: float, n: int) -> dict:
    reward = {"mean": 0.1, "std": 1.0, "q10": -1.0, "q50": 0.1, "q90": 1.2}
    return {
        "n": n,
        "accuracy": accuracy,
        "margin_mean": 0.8,
        "chosen_mean": 0.5,
        "rejected_mean": -0.3,
        "reward": reward,
    }


def eval_result(shift: float) -> EvalResult:
    rows = [
        {"prompt": [{"role": "user", "content": f"count to {n}"}], "response": f"<b>{n} + {shift}</b>",
         "rm_score": n + shift, "gold_score": n - shift, "length": n, "eos": True, "slice": "count" if n % 2 else "list"}
        for n in range(3, 13)
    ]  # fmt: skip
    slices = {
        s: {"n": 5, "eval/reward/rm_score": shift, "eval/gold_score": -shift} for s in ("count", "list")
    }
    return EvalResult(
        metrics={"eval/reward/rm_score": 7.5 + shift, "eval/gold_score": 7.5 - shift},
        rows=rows,
        slices=slices,
    )


@pytest.fixture(scope="module")
def full_run(tmp_path_factory) -> Path:
    """A run with every curve, a config, eval.json and rm_eval.json; its report is built once."""
    run = tmp_path_factory.mktemp("runs") / "default"
    write_metrics(run, ALL_CURVES)
    (run / CONFIG_FILE).write_text("kl:\n  beta: 0.05\n")
    write_eval_json(run, {"sft": eval_result(0.0), "ppo": eval_result(1.0)})
    slices = {
        "type": {"count": summary(0.9, 40), "list": summary(0.6, 30)},
        "length_bucket": {"short": summary(0.7, 70)},
    }
    write_rm_eval_json(run, {**summary(0.75, 70), "slices": slices})
    report(run)
    return run


def embedded_images(page: str) -> dict[str, bytes]:
    return {
        name: base64.b64decode(data)
        for name, data in re.findall(r"<img alt='([^']+)' src='data:image/png;base64,([^']+)'", page)
    }


def test_full_report_embeds_every_png(full_run):
    index = full_run / "report" / "index.html"
    pngs = {p.name: p.read_bytes() for p in (full_run / "report").glob("*.png")}
    assert set(pngs) == {
        "scores.png",
        "kl.png",
        "policy.png",
        "value.png",
        "responses.png",
        "rm_accuracy.png",
        "eval_slices.png",
        "overoptimisation.png",
    }
    assert embedded_images(index.read_text()) == pngs  # self-contained: the page carries the same bytes
    assert all(data.startswith(b"\x89PNG") for data in pngs.values())


def test_full_report_tables_samples_and_config(full_run):
    page = (full_run / "report" / "index.html").read_text()
    assert "win rate vs sft (gold)" in page and "<td>0</td>" in page  # ppo loses on gold on every row
    assert "&lt;b&gt;3 + 1.0&lt;/b&gt;" in page and "<b>3" not in page  # responses are escaped
    assert "user: count to 3" in page
    assert "type=count" in page and "<td>0.9</td>" in page  # RM accuracy per slice
    assert "<details>" in page and "beta: 0.05" in page
    assert (
        json.loads((full_run / EVAL_FILE).read_text())["summary"]["policies"]["ppo"]["eval/win_rate"] == 0.0
    )
    assert json.loads((full_run / RM_EVAL_FILE).read_text())["slices"]["type"]["list"]["n"] == 30


def test_missing_metrics_are_skipped(tmp_path):
    run = tmp_path / "sparse"
    write_metrics(run, ["reward/rm_score", "kl/ref"])
    with MetricsLogger(run) as logger:
        logger.log(
            STEPS + 1, {"reward/rm_score": math.nan, "policy/entropy": math.inf}
        )  # non-finite: not plotted
    page = report(run).read_text()
    assert {p.name for p in (run / "report").glob("*.png")} == {"scores.png", "kl.png"}
    assert set(embedded_images(page)) == {"scores.png", "kl.png"}
    assert (
        "<h2>Held-out evaluation" not in page and "<h2>Reward model" not in page and "<details>" not in page
    )


def test_stale_figures_are_removed(tmp_path):
    run = tmp_path / "rerun"
    write_metrics(run, ["reward/rm_score", "kl/beta"])
    assert report(run) == run / "report" / "index.html"
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "time": 0.0, "kl/beta": 0.1}) + "\n")
    report(run)
    assert {p.name for p in (run / "report").glob("*.png")} == {"kl.png"}


def test_missing_metrics_file_is_a_user_error(tmp_path):
    with pytest.raises(LmppoError, match=r"no .*metrics\.jsonl: train first") as err:
        report(tmp_path / "nothing")
    assert str(tmp_path / "nothing") in str(err.value)


def test_compare_overlays_runs(tmp_path):
    runs = [tmp_path / "default", tmp_path / "beta0"]
    for run, hacking in zip(runs, (False, True)):
        write_metrics(run, ["reward/rm_score", "eval/gold_score"], hacking=hacking)
    page = report(runs[0], compare=[runs[1]]).read_text()
    assert "default vs beta0" in page and "beta0: 6 records, last step 6" in page
    assert set(embedded_images(page)) == {"scores.png"} and not (runs[1] / "report").exists()
    with pytest.raises(LmppoError, match="train first"):
        report(runs[0], compare=[tmp_path / "missing"])


def test_the_report_opens_with_the_diagnosis_and_plots_held_out_scores_against_kl(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    records = [
        {"step": s, "policy/clip_frac": 0.45, "reward/rm_score": 0.1 * s}
        | ({"eval/gold_score": 1.0 - abs(s - 4) * 0.2, "eval/kl/ref": 0.5 * s} if s % 2 == 0 else {})
        for s in range(0, 11)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    page = report(run).read_text()
    assert page.index("<h2>Diagnosis</h2>") < page.index("Training curves") and "stale_batches" in page
    assert "overoptimisation.png" in embedded_images(page)
    assert "the best evaluation, kept as best/" in page


def test_the_reward_preflight_is_shown_with_its_slices_and_extreme_samples(tmp_path):
    from lmppo.runs.preflight import summarise, write_preflight_json

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 0, "preflight/samples": 6.0}) + "\n")
    rows = [
        {"prompt": "hi", "response": f"answer {n} <b>", "rm_score": float(n), "length": n, "eos": True,
         "slice": "ab"[n % 2]}
        for n in range(6)
    ]  # fmt: skip
    write_preflight_json(run, summarise(rows))
    page = report(run).read_text()
    section = page[page.index("Reward pre-flight") :]
    assert "preflight/length_spearman" in section and "<td>ab</td>" not in section
    assert "<td>a</td>" in section and "answer 5 &lt;b&gt;" in section  # escaped, highest first


def test_reward_components_get_a_panel_each(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    records = [
        {"step": s, "reward/rm_score": 0.1 * s, "reward/rm/raw": 0.2 * s, "reward/rm/used": 0.2 * s,
         "reward/format/raw": -0.05 * s, "reward/format/used": -0.05 * s}
        for s in range(1, 6)
    ]  # fmt: skip
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert "components.png" in embedded_images(report(run).read_text())
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/rm_score": 0.1}) + "\n")
    report(run)
    assert not (run / "report" / "components.png").exists()  # a one-source run has none


def test_the_report_names_the_reward_as_the_run_gives_it(full_run, tmp_path):
    assert (
        "Reward model vs gold judge: the RM score rising" in (full_run / "report" / "index.html").read_text()
    )
    run = tmp_path / "function"
    write_metrics(run, ["reward/rm_score", "kl/ref"])
    (run / CONFIG_FILE).write_text("reward:\n  function: my_rewards.py:score\n")
    page = report(run).read_text()
    assert "Reward vs gold judge: the reward rising" in page and "RM score" not in page


def test_an_episode_shows_the_policys_turns_and_greys_the_context_between_them():
    row = {
        "response": "it is 42.",
        "rm_score": 1.0,
        "episode": [
            {"text": "<tool_call>{}</tool_call><|im_end|>", "action": True},
            {"text": "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n", "action": False},
            {"text": "it is 42.<|im_end|>", "action": True},
        ],
    }
    cell = _response_cell(row)
    assert cell.startswith("&lt;tool_call&gt;{}&lt;/tool_call&gt;&lt;|im_end|&gt;<span class='context'>")
    assert "<span class='context'>\n&lt;|im_start|&gt;tool\n42" in cell and "</span>it is 42." in cell


def test_an_episode_s_reward_is_what_the_report_plots_and_shows():
    row = {"prompt": "p", "response": "b", "rm_score": 0.0, "turn_reward": 0.5, "total_reward": 0.5}
    row["episode"] = [
        {"text": "a", "action": True},
        {"text": "ctx", "action": False},
        {"text": "b", "action": True},
    ]
    assert _response_cell(row).endswith("<small>reward 0.5</small>")  # not "RM 0": the turns' alone
    assert "<small>reward 1.5 (final 1, turn 0.5)</small>" in _response_cell(
        {**row, "rm_score": 1.0, "total_reward": 1.5}
    )
    records = [{"step": 1, "reward/rm_score": 0.0, "reward/turn": 0.5, "reward/total": 0.5}]
    _, panels = score_curves("environment reward", records)
    assert panels[0].metrics == ("reward/total", "eval/reward/total") and "parts" not in panels[1].title
    _, panels = score_curves("reward", [{**records[0], "reward/rm_score": 1.0, "reward/total": 1.5}])
    assert panels[1].metrics == ("reward/rm_score", "reward/turn")
    _, panels = score_curves("RM score", [{"step": 1, "reward/rm_score": 1.0}])  # no episode: as ever
    assert panels[0] == Panel("RM score (training, held-out)", ("reward/rm_score", "eval/reward/rm_score"))
