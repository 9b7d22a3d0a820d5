"""Plots (matplotlib) and a self-contained HTML report of a run directory.

Reads, from ``RUN_DIR``:

- ``metrics.jsonl`` (required; written by :class:`lmppo.training.metrics.MetricsLogger`);
- ``config.yaml`` (optional): the resolved config, shown in a collapsed block;
- ``eval.json`` (optional, written by :func:`lmppo.runs.evaluate.write_eval_json`)::

      {"summary":  {"baseline": "sft", "judge": "gold" | "rm", "score": "RM score" | "reward",
                    "policies": {name: {"eval/reward/rm_score": float, "eval/win_rate": float, ...}}},
       "policies": {name: {"metrics": {"eval/...": float},
                           "slices":  {slice: {"n": int, "eval/...": float}},
                           "rows":    [{"prompt", "response", "rm_score", "length", "eos",
                                        "gold_score"?, "kl_ref"?, "slice"?, "turn_reward"?,
                                        "total_reward"?, "episode"?}, ...]}}}

  ``summary`` is :func:`lmppo.runs.evaluate.compare_policies`; each policy is an ``EvalResult.to_dict()``,
  all evaluated on the same prompts in the same order (rows pair up by index);
- ``preflight.json`` (optional, written by :func:`lmppo.runs.preflight.write_preflight_json`): the reward
  pre-flight, ``{"metrics": {"preflight/...": float}, "slices": {slice: {"n", "rm_score_mean",
  "rm_score_std", "eos_frac", "length_mean"}}, "examples": {"highest" | "lowest": [row, ...]}}``;
- ``rm_eval.json`` (optional, written by :func:`lmppo.training.reward_modeling.write_rm_eval_json`): the dict
  of :func:`lmppo.training.reward_modeling.evaluate_reward_model`, i.e. ``{"n", "accuracy", "margin_mean",
  "chosen_mean", "rejected_mean", "reward": {"mean", "std", "q10", "q50", "q90"}, "slices": {key: {value:
  <same summary>}}}``.

Writes ``RUN_DIR/report/*.png`` and ``RUN_DIR/report/index.html``, which embeds every PNG (base64)
so the page alone can be mailed. Metrics a run did not log are skipped, and so is a figure left empty.
"""

from __future__ import annotations

import base64
import html
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml
from matplotlib.figure import Figure

from lmppo.errors import LmppoError
from lmppo.inputs.config import RewardConfig
from lmppo.runs.diagnose import Finding, diagnose, run_thresholds
from lmppo.runs.evaluate import EVAL_FILE, reward_text, summary_columns
from lmppo.runs.preflight import PREFLIGHT_FILE
from lmppo.training.metrics import METRICS_FILE, read_metrics
from lmppo.training.reward_modeling import RM_EVAL_FILE

CONFIG_FILE = "config.yaml"
REPORT_DIR = "report"
INDEX_FILE = "index.html"
SAMPLE_ROWS = 8  # responses shown side by side
RM_SLICE_HEADER = ("slice", "n", "accuracy", "margin", "chosen mean", "rejected mean", "q10", "q50", "q90")


@dataclass(frozen=True)
class Panel:
    """One subplot: metrics over steps. Training metrics are lines; sparse eval/* ones get markers."""

    title: str
    metrics: tuple[str, ...]


SCORES = "scores"


def score_curves(score: str, records: Sequence[dict]) -> tuple[str, tuple[Panel, ...]]:
    """The scores figure, in the words of the run's reward (:meth:`RewardConfig.score_name`); in an episode
    the reward is ``reward/total``, its parts in a panel of their own where both are non-zero."""
    caption = (
        f"{'Reward model' if score == 'RM score' else 'Reward'} vs gold judge: the {score} rising while the "
        "gold score stalls or falls is reward hacking."
    )
    if not _series(records, "reward/total")[0]:
        reward = (Panel(f"{score} (training, held-out)", ("reward/rm_score", "eval/reward/rm_score")),)
    else:
        reward = (Panel(f"{score} (training, held-out)", ("reward/total", "eval/reward/total")),)
        if all(any(_series(records, part)[1]) for part in ("reward/rm_score", "reward/turn")):
            reward += (Panel("its parts: final score and turn rewards", ("reward/rm_score", "reward/turn")),)
    return caption, (
        *reward,
        Panel("gold score (hidden judge)", ("eval/gold_score",)),
        Panel("held-out demo perplexity (alignment tax)", ("eval/demo_ppl",)),
    )


# figure name -> (caption, panels); the scores figure first, in the run's own words (score_curves)
CURVES: dict[str, tuple[str, tuple[Panel, ...]]] = {
    "kl": (
        "KL to the reference (nats per sequence) and the KL coefficient.",
        (Panel("KL(policy || reference)", ("kl/ref", "eval/kl/ref")), Panel("beta", ("kl/beta",))),
    ),
    "policy": (
        "Policy update: loss, clipping, entropy and how far each step moved the policy.",
        (
            Panel("policy loss", ("policy/loss",)),
            Panel("clip fraction", ("policy/clip_frac", "value/clip_frac")),
            Panel("entropy (nats/token)", ("policy/entropy",)),
            Panel("approx KL(old || new)", ("policy/approx_kl",)),
        ),
    ),
    "value": (
        "Critic: value loss and explained variance (1 = perfect, 0 = a constant).",
        (Panel("value loss", ("value/loss",)), Panel("explained variance", ("value/explained_var",))),
    ),
    "responses": (
        "Responses: length in tokens (EOS included) and the fraction that ended with EOS.",
        (
            Panel("length (tokens)", ("response/length", "eval/response/length")),
            Panel("EOS fraction", ("response/eos_frac", "eval/response/eos_frac")),
        ),
    ),
}
COMPONENTS = "components"  # one panel per reward component, when the run has several
RM_ACCURACY = "rm_accuracy"
EVAL_SLICES = "eval_slices"
OVEROPTIMISATION = "overoptimisation"
LINE_STYLES = ("-", "--", ":")


@dataclass(frozen=True)
class Bars:
    """One bar subplot: a bar per category for each series; an optional dashed reference line."""

    title: str
    categories: list[str]
    series: dict[str, list[float]]
    reference: float | None = None
    ylim: tuple[float, float] | None = None


def _read_json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise LmppoError(f"{path} is not valid JSON ({err.msg}); delete it or write it again") from None


# --------------------------------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------------------------------


def report(run_dir: str | Path, compare: Sequence[str | Path] = ()) -> Path:
    """Write ``RUN_DIR/report/`` (PNGs and a self-contained ``index.html``); return the HTML's path.

    ``compare``: other run directories whose curves are overlaid on this run's (e.g. beta = 0 against
    the default, to show reward hacking); their eval and RM files are not read.
    """
    run_dir = Path(run_dir)
    runs = _load_runs([run_dir, *map(Path, compare)])
    out = run_dir / REPORT_DIR
    out.mkdir(parents=True, exist_ok=True)
    for name in [SCORES, *CURVES, COMPONENTS, RM_ACCURACY, EVAL_SLICES, OVEROPTIMISATION]:
        (out / f"{name}.png").unlink(missing_ok=True)  # a figure this run no longer has must not linger

    evaluation = _read_json(run_dir / EVAL_FILE)
    rm_eval = _read_json(run_dir / RM_EVAL_FILE)
    preflight = _read_json(run_dir / PREFLIGHT_FILE)
    config = run_dir / CONFIG_FILE
    score = _score_name(config)
    sections = [_diagnosis_section(diagnose(runs[0][1], run_thresholds(run_dir)))]
    if evaluation:
        sections.append(_evaluation_section(evaluation, out))
    sections.append(_curves_section(runs, out, score))
    if _plot_overoptimisation(out / f"{OVEROPTIMISATION}.png", runs, score):
        caption = (
            "held-out scores against sqrt(KL to the reference) at each evaluation: under over-optimisation "
            "the judge's score rises, then falls while KL grows (Gao et al. 2022); the star is the best "
            "evaluation, kept as best/"
        )
        sections.append(_figure_html(out / f"{OVEROPTIMISATION}.png", caption))
    if preflight:
        sections.append(_preflight_section(preflight))
    if rm_eval:
        sections.append(_rm_section(rm_eval, out))
    if config.is_file():
        summary = f"<summary>resolved config ({CONFIG_FILE})</summary>"
        sections.append(f"<details>{summary}<pre>{_esc(config.read_text())}</pre></details>")
    title = f"lmppo report: {run_dir.name}" + "".join(f" vs {name}" for name, _ in runs[1:])
    index = out / INDEX_FILE
    index.write_text(_page(title, runs, sections))
    return index


def _score_name(config: Path) -> str:
    """The run's reward's name (:meth:`RewardConfig.score_name`, from its ``config.yaml``; a run without a
    reward section there: a reward model's)."""
    sections = (yaml.safe_load(config.read_text()) or {}) if config.is_file() else {}
    if not sections.get("reward"):
        return "RM score"
    rollout = sections.get("rollout") or {}
    reward = RewardConfig.model_validate(sections["reward"])
    return reward.score_name(bool(rollout.get("environment") or rollout.get("tools")))


def _load_runs(run_dirs: Sequence[Path]) -> list[tuple[str, list[dict]]]:
    """(label, metric records) per run; labels are directory names unless two runs share one."""
    for run_dir in run_dirs:
        if not (run_dir / METRICS_FILE).is_file():
            raise LmppoError(
                f"no {run_dir / METRICS_FILE}: train first (`lmppo ppo CONFIG` or `lmppo quickstart`) so "
                f"{run_dir} is a run directory, then run `lmppo report {run_dir}`"
            )
    names = [d.name for d in run_dirs]
    labels = names if len(set(names)) == len(names) else [str(d) for d in run_dirs]
    return [(label, read_metrics(d)) for label, d in zip(labels, run_dirs)]


def _series(records: Sequence[dict], metric: str) -> tuple[list[int], list[float]]:
    """Steps and finite values of ``metric`` in the records that logged it."""
    points = [(r["step"], r[metric]) for r in records if metric in r and math.isfinite(r[metric])]
    return [s for s, _ in points], [v for _, v in points]


# --------------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------------


def _curves_section(runs: list[tuple[str, list[dict]]], out: Path, score: str) -> str:
    figures = [
        _figure_html(out / f"{name}.png", caption)
        for name, (caption, panels) in {
            SCORES: score_curves(score, runs[0][1]),
            **CURVES,
            **_component_curves(runs[0][1]),
        }.items()
        if _plot_curves(out / f"{name}.png", panels, runs)
    ]
    return "<h2>Training curves</h2>" + ("".join(figures) or "<p>No known metrics logged yet.</p>")


def _component_curves(records: Sequence[dict]) -> dict[str, tuple[str, tuple[Panel, ...]]]:
    """With reward.components: each component's raw training and held-out score and its weighted,
    preprocessed share, one panel each, so one rising while another falls is seen."""
    names = sorted(
        {k.split("/")[1] for r in records for k in r if k.startswith("reward/") and k.endswith("/raw")}
    )
    if not names:
        return {}
    panels = tuple(
        Panel(
            f"reward component {name}",
            (f"reward/{name}/raw", f"eval/reward/{name}/raw", f"reward/{name}/used"),
        )
        for name in names
    )
    caption = "Reward components apart: raw score (training and held-out) and the weighted share PPO used."
    return {COMPONENTS: (caption, panels)}


def _diagnosis_section(findings: list[Finding]) -> str:
    """The failure modes :mod:`lmppo.runs.diagnose` finds in the run's metrics, first thing on the page."""
    if not findings:
        return "<h2>Diagnosis</h2><p>No known PPO failure mode in the metrics (docs/diagnosis.md).</p>"
    items = "".join(f"<li>{_esc(str(finding))}</li>" for finding in findings)
    return f"<h2>Diagnosis</h2><ul>{items}</ul>"


def _evaluation_section(evaluation: dict, out: Path) -> str:
    summary, policies = evaluation["summary"], evaluation["policies"]
    columns = summary_columns(summary)
    table = _table(
        ["policy", *(label for _, label in columns)],
        [[name, *(_fmt(values.get(m)) for m, _ in columns)] for name, values in summary["policies"].items()],
    )
    parts = ["<h2>Held-out evaluation</h2>", table]
    slice_names = sorted({s for p in policies.values() for s in p["slices"]})
    if slice_names:
        parts.append(_slices_html(policies, slice_names, out))
    parts.append(_samples_html(policies))
    return "".join(parts)


def _slices_html(policies: Mapping[str, dict], slice_names: list[str], out: Path) -> str:
    """Grouped bars: each policy's mean gold score and reward (an episode's total) per slice."""
    bars = []
    for metric in ("eval/gold_score", _held_out_reward([p["metrics"] for p in policies.values()])):
        series = {
            name: [p["slices"].get(s, {}).get(metric, math.nan) for s in slice_names]
            for name, p in policies.items()
        }
        if any(math.isfinite(v) for values in series.values() for v in values):
            bars.append(Bars(metric, slice_names, series))
    path = out / f"{EVAL_SLICES}.png"
    _plot_bars(path, bars)
    return _figure_html(path, "Mean held-out scores per slice.")


def _samples_html(policies: Mapping[str, dict]) -> str:
    names = list(policies)
    first = policies[names[0]]["rows"][:SAMPLE_ROWS]
    rows = [
        [_prompt_text(row["prompt"]), *(_response_cell(policies[name]["rows"][i]) for name in names)]
        for i, row in enumerate(first)
    ]
    heading = f"<h3>Sample responses (first {len(rows)} held-out prompts)</h3>"
    return heading + _table(["prompt", *names], rows, escape=False)


def _held_out_reward(records: Sequence[Mapping]) -> str:
    """The held-out reward's metric: an episode's total where the records have it, else the score."""
    return "eval/reward/total" if any("eval/reward/total" in r for r in records) else "eval/reward/rm_score"


def _response_cell(row: dict) -> str:
    gold = f", gold {_fmt(row['gold_score'])}" if "gold_score" in row else ""
    return f"{_response_text(row)}<br><small>{_esc(reward_text(row))}{gold}</small>"


def _response_text(row: dict) -> str:
    """The response; an episode whole, the policy's turns as text and the context between them greyed."""
    if "episode" not in row:
        return _esc(row["response"])
    return "".join(
        _esc(run["text"]) if run["action"] else f"<span class='context'>{_esc(run['text'])}</span>"
        for run in row["episode"]
    )


def _prompt_text(prompt) -> str:
    text = prompt if isinstance(prompt, str) else " / ".join(f"{m['role']}: {m['content']}" for m in prompt)
    return _esc(text)


def _preflight_section(preflight: dict) -> str:
    """The reward pre-flight: how the reward scored the starting policy's samples before step 1."""
    metrics = preflight["metrics"]
    parts = [
        "<h2>Reward pre-flight (the starting policy's samples, before step 1)</h2>",
        _table(["metric", "value"], [[name, _fmt(value)] for name, value in metrics.items()]),
    ]
    if preflight["slices"]:
        columns = list(next(iter(preflight["slices"].values())))
        rows = [[name, *(_fmt(values[c]) for c in columns)] for name, values in preflight["slices"].items()]
        parts.append(_table(["slice", *columns], rows))
    samples = [
        [which, _prompt_text(row["prompt"]), _response_cell(row), str(row["length"])]
        for which, rows in preflight["examples"].items()
        for row in rows
    ]
    parts.append(_table(["", "prompt", "response", "length"], samples, escape=False))
    return "".join(parts)


def _rm_section(rm_eval: dict, out: Path) -> str:
    accuracy, n, margin = rm_eval["accuracy"], rm_eval["n"], rm_eval["margin_mean"]
    parts = [
        "<h2>Reward model (held-out preference pairs)</h2>",
        f"<p>accuracy {_fmt(accuracy)} on {n} pairs; mean margin (chosen - rejected) {_fmt(margin)}</p>",
    ]
    slices = rm_eval.get("slices", {})
    if slices:
        path = out / f"{RM_ACCURACY}.png"
        bars = [
            Bars(
                f"accuracy by {key}",
                [f"{value} (n={s['n']})" for value, s in values.items()],
                {"accuracy": [s["accuracy"] for s in values.values()]},
                reference=accuracy,
                ylim=(0.0, 1.0),
            )
            for key, values in slices.items()
        ]
        _plot_bars(path, bars)
        parts.append(_figure_html(path, "Accuracy per slice (dashed: overall)."))
        rows = [
            _rm_slice_row(f"{key}={value}", s)
            for key, values in slices.items()
            for value, s in values.items()
        ]
        parts.append(_table(list(RM_SLICE_HEADER), rows))
        parts.append("<p><small>q10 / q50 / q90: quantiles of all rewards (chosen and rejected).</small></p>")
    return "".join(parts)


def _rm_slice_row(name: str, s: dict) -> list[str]:
    """One row of RM_SLICE_HEADER: accuracy and reward distribution of one slice."""
    stats = (s["accuracy"], s["margin_mean"], s["chosen_mean"], s["rejected_mean"])
    quantiles = (s["reward"][q] for q in ("q10", "q50", "q90"))
    return [name, str(s["n"]), *map(_fmt, stats), *map(_fmt, quantiles)]


# --------------------------------------------------------------------------------------------------
# Plots
# --------------------------------------------------------------------------------------------------


def _plot_curves(path: Path, panels: Sequence[Panel], runs: list[tuple[str, list[dict]]]) -> bool:
    """One row of panels, one colour per run; returns False (and writes nothing) without data."""
    present = [p for p in panels if any(_series(records, m)[0] for _, records in runs for m in p.metrics)]
    if not present:
        return False
    fig = Figure(figsize=(4.5 * len(present), 3.4), layout="constrained")
    for ax, panel in zip(fig.subplots(1, len(present), squeeze=False)[0], present):
        for color, (label, records) in enumerate(runs):
            for style, metric in zip(LINE_STYLES, panel.metrics):
                steps, values = _series(records, metric)
                marker = "o" if metric.startswith("eval/") else None  # logged every eval_every steps only
                name = metric if len(runs) == 1 else f"{label}: {metric}"
                if steps:
                    ax.plot(
                        steps, values, linestyle=style, marker=marker, ms=3, color=f"C{color}", label=name
                    )
        ax.set(title=panel.title, xlabel="step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.savefig(path, dpi=100)
    return True


def _plot_overoptimisation(path: Path, runs: list[tuple[str, list[dict]]], score: str) -> bool:
    """Each held-out score against sqrt(eval/kl/ref), one colour per run, the best point starred;
    returns False (and writes nothing) when no run evaluated KL and a score together."""
    scores = (
        ("eval/gold_score", "held-out judge score"),
        (_held_out_reward([r for _, records in runs for r in records]), f"held-out {score}"),
    )

    def points(records, metric):
        return [
            (math.sqrt(max(r["eval/kl/ref"], 0.0)), r[metric], r["step"])
            for r in records
            if metric in r
            and "eval/kl/ref" in r
            and math.isfinite(r[metric])
            and math.isfinite(r["eval/kl/ref"])
        ]

    present = [(m, t) for m, t in scores if any(points(records, m) for _, records in runs)]
    if not present:
        return False
    fig = Figure(figsize=(4.5 * len(present), 3.4), layout="constrained")
    for ax, (metric, title) in zip(fig.subplots(1, len(present), squeeze=False)[0], present):
        for color, (label, records) in enumerate(runs):
            curve = points(records, metric)
            if not curve:
                continue
            ax.plot(
                [x for x, _, _ in curve],
                [y for _, y, _ in curve],
                marker="o",
                ms=3,
                color=f"C{color}",
                label=label,
            )
            best_x, best_y, best_step = max(curve, key=lambda point: point[1])
            ax.plot([best_x], [best_y], marker="*", ms=12, color=f"C{color}")
            ax.annotate(
                f"step {best_step}", (best_x, best_y), fontsize=7, xytext=(4, 4), textcoords="offset points"
            )
        ax.set(title=title, xlabel="sqrt(KL to reference) (nats^0.5)", ylabel=metric)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.savefig(path, dpi=100)
    return True


def _plot_bars(path: Path, panels: Sequence[Bars]) -> None:
    """Grouped bar charts side by side."""
    fig = Figure(figsize=(4.5 * len(panels), 3.4), layout="constrained")
    for ax, panel in zip(fig.subplots(1, len(panels), squeeze=False)[0], panels):
        width = 0.8 / len(panel.series)
        for i, (label, values) in enumerate(panel.series.items()):
            offsets = [x + (i - (len(panel.series) - 1) / 2) * width for x in range(len(panel.categories))]
            ax.bar(offsets, values, width, label=label, color=f"C{i}")
        if panel.reference is not None:
            ax.axhline(panel.reference, color="gray", linestyle="--")
        ax.set_xticks(range(len(panel.categories)), panel.categories, rotation=30, ha="right")
        ax.set(title=panel.title, ylim=panel.ylim)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=7)
    fig.savefig(path, dpi=100)


# --------------------------------------------------------------------------------------------------
# HTML
# --------------------------------------------------------------------------------------------------

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1400px; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.3em 0.6em; text-align: left; vertical-align: top; }
th { background: #f3f3f3; }
figure { margin: 1em 0; } img { max-width: 100%; } figcaption { color: #555; font-size: 0.9em; }
pre { background: #f7f7f7; padding: 1em; overflow-x: auto; }
.context { color: #888; background: #f2f2f2; font-family: monospace; white-space: pre-wrap; }
"""


def _page(title: str, runs: list[tuple[str, list[dict]]], sections: list[str]) -> str:
    steps = ", ".join(
        f"{label}: {len(records)} records, last step {records[-1]['step'] if records else '-'}"
        for label, records in runs
    )
    return (
        f"<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>{_esc(title)}</title><style>{_STYLE}</style></head>"
        f"<body><h1>{_esc(title)}</h1><p>{_esc(steps)}</p>{''.join(sections)}</body></html>\n"
    )


def _figure_html(png: Path, caption: str) -> str:
    """The PNG embedded as base64, so the page needs no other file."""
    data = base64.b64encode(png.read_bytes()).decode("ascii")
    return f"<figure><img alt='{png.name}' src='data:image/png;base64,{data}'><figcaption>{_esc(caption)}</figcaption></figure>"


def _table(header: list[str], rows: list[list[str]], escape: bool = True) -> str:
    cell = _esc if escape else str
    head = "".join(f"<th>{_esc(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{cell(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _esc(text: str) -> str:
    return html.escape(str(text))


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"
