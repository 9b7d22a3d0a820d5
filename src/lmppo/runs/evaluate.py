"""Held-out evaluation of a policy: reward-model and gold scores, KL to the reference, alignment tax.

Responses are *sampled* with the training decoding (:func:`lmppo.runs.build.generator_options`), not decoded
greedily: the evaluated artifact is the policy with its decoding, the KL estimate needs samples from the
policy (a k1 sum over a greedy response is not a KL), and reward hacking shows up in what the sampler
produces. Sampling noise is controlled instead: every evaluation draws from its own generator state
seeded with ``seed`` (common random numbers, so SFT and PPO face the same noise), inside
``torch.random.fork_rng`` so a periodic evaluation during PPO leaves the training RNG stream as it was.

Metrics are the training metrics' names under ``eval/`` (docs/metrics.md): ``eval/reward/rm_score``,
``eval/kl/ref`` (mean per-sequence sum of the k1 estimate), ``eval/response/length``,
``eval/response/eos_frac``; with ``reward.components``, ``eval/reward/<name>/raw`` per component; with
episodes, ``eval/reward/turn`` (the environment's rewards), ``eval/reward/total`` (the reward: the score plus
the turn rewards, what the table and the win rate judge by) and ``eval/episode/{turns,tool_calls,
tool_failures,timeouts}``; and
``eval/gold_score`` (when a gold judge is given), ``eval/demo_ppl``
(perplexity of held-out demonstrations: the alignment tax) and, from :func:`compare_policies`,
``eval/win_rate`` (against the baseline policy on the same prompts).

This module owns ``eval.json`` (:func:`write_eval_json`); the report only reads it.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from rich.table import Table

from lmppo.errors import LmppoError, user_code_error
from lmppo.inputs.config import Config, load_config
from lmppo.inputs.data import Prompt, load_demonstrations, load_prompt_rows, load_prompts
from lmppo.inputs.resolve import RunSpec, frozen_policy_source, resolve
from lmppo.math.core import kl_estimate
from lmppo.modeling.distributed import all_sum, failing_together, gather_objects, gathered
from lmppo.modeling.loading import load_causal_lm, load_tokenizer
from lmppo.modeling.models import autocast, eval_mode
from lmppo.progress import advance
from lmppo.rewards.scoring import RewardFunction
from lmppo.runs.build import configured_vllm, generator_options, load_reward, policy_generator
from lmppo.sampling.engines import Generator
from lmppo.sampling.hf_engine import hf_generator
from lmppo.sampling.passes import sequence_logprobs
from lmppo.sampling.rollout import Rollout
from lmppo.training.sft import response_nll_sum
from lmppo.user_code import load_function

GoldJudge = Callable[[Prompt, str], float]  # (prompt, response text) -> score, e.g. lmppo.toy.task.gold_score
EVAL_FILE = "eval.json"

# Per-row field -> the metric that averages it (overall and per slice).
ROW_METRICS = {
    "rm_score": "eval/reward/rm_score",
    "gold_score": "eval/gold_score",
    "kl_ref": "eval/kl/ref",
    "length": "eval/response/length",
    "eos": "eval/response/eos_frac",
    "turn_reward": "eval/reward/turn",  # an episode's: the environment's rewards summed
    "total_reward": "eval/reward/total",  # an episode's: rm_score + turn_reward, what the run optimises
    "turns": "eval/episode/turns",
    "tool_calls": "eval/episode/tool_calls",
    "tool_failures": "eval/episode/tool_failures",
    "timeouts": "eval/episode/timeouts",
}
# (metric, column label) of the comparison table; "{baseline}", "{judge}" and "{score}" are filled in.
SUMMARY_COLUMNS = (
    ("eval/reward/total", "{score}"),
    ("eval/reward/rm_score", "{final}"),
    ("eval/reward/turn", "turn reward"),
    ("eval/gold_score", "gold score"),
    ("eval/win_rate", "win rate vs {baseline} ({judge})"),
    ("eval/kl/ref", "KL to ref"),
    ("eval/demo_ppl", "demo ppl"),
    ("eval/response/length", "length"),
    ("eval/response/eos_frac", "EOS rate"),
    ("eval/episode/turns", "turns"),
    ("eval/episode/tool_failures", "failed calls"),
)


@dataclass
class EvalResult:
    """``metrics``: eval/* means; ``rows``: one dict per prompt (prompt, response, rm_score, and
    gold_score, kl_ref, slice when available; length, eos); ``slices``: slice -> n and eval/* means."""

    metrics: dict[str, float]
    rows: list[dict] = field(default_factory=list)
    slices: dict[str, dict[str, float]] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def evaluate_policy(
    policy,
    tokenizer,
    prompts: Sequence[Prompt],
    *,
    reward_fn: RewardFunction,
    reference=None,
    gold_fn: GoldJudge | None = None,
    demonstrations: Sequence[dict] | None = None,
    generator_options: Mapping,
    slices: Sequence[str] | None = None,
    batch_size: int = 32,
    seed: int = 0,
    group: torch.distributed.ProcessGroup | None = None,
    generator: Generator | None = None,
    sample_ids: Sequence[int] | None = None,
    rows: Sequence[dict] | None = None,
    forward_batching: Mapping | None = None,
) -> EvalResult:
    """Sample one response per held-out prompt and measure it (see the module docstring).

    ``generator_options``: :func:`~lmppo.sampling.hf_engine.hf_generator`'s keywords, as
    :func:`lmppo.runs.build.generator_options`
    gives them; ``reference``: the frozen reference for ``eval/kl/ref``; ``gold_fn``: a per-row gold
    judge; ``demonstrations``: held-out {"prompt", "response"} rows for ``eval/demo_ppl``; ``slices``:
    each prompt's slice name (e.g. its task type) for per-slice means. With a process
    ``group`` each rank passes its own share of prompts and demonstrations; rows and sums are gathered,
    so every rank returns the same, global result. ``generator``: the run's engine when it has its own
    (vLLM, holding ``policy``'s weights), else the transformers decode loop on ``policy``; ``sample_ids``:
    each prompt's place in the whole held-out set (a seeded engine draws from them); ``rows``: each
    prompt's whole row, which an episode's environment resets on; ``forward_batching``: the KL passes'
    ``forward_batch_size`` / ``forward_batch_tokens``, as the run's stored passes take them (default:
    the whole batch in one forward).
    """
    if not prompts and group is None:
        raise LmppoError("evaluation: no held-out prompts; check data.eval_prompts")
    generator = generator or hf_generator(policy, tokenizer, **generator_options)
    sample_ids = list(range(len(prompts))) if sample_ids is None else list(sample_ids)
    measured = []
    with _seeded_rng(seed, policy), failing_together(group):  # a judge failing on one rank stops all
        for start in range(0, len(prompts), batch_size):
            end = start + batch_size
            advance("prompts", min(end, len(prompts)), len(prompts))
            batch_rows = None if rows is None else rows[start:end]
            rollout = generator.generate(prompts[start:end], 0, sample_ids[start:end], batch_rows)
            measured += _measure(rollout, reward_fn, policy, reference, gold_fn, forward_batching or {})
    for row, name in zip(measured, slices or ()):
        row["slice"] = str(name)
    rows = [row for rank_rows in gather_objects(measured, group) for row in rank_rows]
    metrics = _means(rows)
    if demonstrations is not None:
        with eval_mode(policy):
            nll = (
                response_nll_sum(policy, tokenizer, demonstrations, batch_size, **_rendering(generator))
                if demonstrations
                else (0.0, 0)
            )
        total, count = all_sum(torch.tensor(nll, dtype=torch.float64), group).tolist()
        metrics["eval/demo_ppl"] = math.exp(total / max(count, 1))
    return EvalResult(metrics=metrics, rows=rows, slices=_slice_means(rows) if slices is not None else {})


def _rendering(generator: Generator) -> dict[str, Any]:
    """How the generator renders prompts (its chat template, the run's tool schemas): the demonstrations'
    perplexity is measured on the tokens the policy is sampled on."""
    return {"chat_template": generator.renderer.chat_template, "tools": generator.renderer.tools}


def run_evaluator(
    cfg, models, rank: int = 0, world_size: int = 1, group=None, generator: Generator | None = None
) -> Callable[[], dict[str, float]]:
    """The held-out evaluation ``lmppo ppo`` runs every ``run.eval_every`` steps, from the config:
    ``data.eval_prompts`` scored by the run's reward and ``data.eval_judge``, KL to the reference,
    ``data.eval_demonstrations``' perplexity. Each rank takes every ``world_size``-th prompt and
    demonstration; the metrics are global. Sampling draws from its own seeded stream (training's
    RNG is untouched), with the same seed every time, so evaluations differ only by the policy.
    ``generator``: the run's own engine when it samples from its own weights (vLLM), synced to the policy, or
    plays episodes (``rollout.environment``, which resets on each held-out prompt's whole row)."""
    every_prompt = load_prompts(cfg.data.eval_prompts, key=cfg.data.prompt_key)
    prompts = every_prompt[rank::world_size]
    sample_ids = list(range(len(every_prompt)))[rank::world_size]
    rows = load_prompt_rows(cfg.data.eval_prompts)[rank::world_size]
    gold_fn = load_function(cfg.data.eval_judge, "data.eval_judge") if cfg.data.eval_judge else None
    demonstrations = None
    if cfg.data.eval_demonstrations:
        pairs = load_demonstrations(cfg.data.eval_demonstrations)[rank::world_size]
        demonstrations = [{"prompt": prompt, "response": response} for prompt, response in pairs]

    def evaluate() -> dict[str, float]:
        return evaluate_policy(
            models.policy,
            models.tokenizer,
            prompts,
            reward_fn=models.reward,
            reference=models.reference,
            gold_fn=gold_fn,
            demonstrations=demonstrations,
            generator_options=generator_options(cfg),
            batch_size=cfg.run.eval_batch_size,
            seed=cfg.run.seed,
            group=group,
            generator=generator,
            sample_ids=sample_ids,
            rows=rows,
            forward_batching={
                "forward_batch_size": cfg.rollout.forward_batch_size,
                "forward_batch_tokens": cfg.rollout.forward_batch_tokens,
            },
        ).metrics

    return evaluate


@contextlib.contextmanager
def _seeded_rng(seed: int, model) -> Iterator[None]:
    """Seed the RNG that ``generate`` samples from (CPU, or the model's GPU); restore it afterwards."""
    device = next(model.parameters()).device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.default_generator.manual_seed(seed)
        if device.type == "cuda":
            with torch.cuda.device(device):
                torch.cuda.manual_seed(seed)
        yield


def _measure(
    rollout: Rollout, reward_fn, policy, reference, gold_fn, forward_batching: Mapping
) -> list[dict]:
    """Per-row records of one generated batch."""
    components = (  # several named rewards: each one's raw score too
        reward_fn.raw_scores(rollout.prompts, rollout.response_texts)
        if getattr(reward_fn, "named", False)
        else {}
    )
    scores = (
        reward_fn.weighted(components) if components else reward_fn(rollout.prompts, rollout.response_texts)
    )
    rows = [
        {"prompt": prompt, "response": response, "rm_score": score, "length": int(length), "eos": bool(eos)}
        for prompt, response, score, length, eos in zip(
            rollout.prompts,
            rollout.response_texts,
            scores.tolist(),
            rollout.response_lengths,
            rollout.terminated,
        )
    ]
    for i, row in enumerate(rows if components else ()):
        row["components"] = {name: float(values[i]) for name, values in components.items()}
    episode = rollout.episode
    for i, transcript in enumerate(episode.transcripts if episode else ()):  # its turns and context
        rows[i]["episode"] = [{"text": text, "action": action} for text, action in transcript]
        rows[i]["turn_reward"] = float(episode.turn_rewards[i].sum())
        rows[i]["total_reward"] = rows[i]["rm_score"] + rows[i]["turn_reward"]
        for name, counts in episode.counts.items():
            rows[i][name] = int(counts[i])
    if reference is not None:
        for row, kl in zip(rows, _sequence_kl(policy, reference, rollout, forward_batching).tolist()):
            row["kl_ref"] = kl
    for row in rows if gold_fn is not None else ():
        try:
            row["gold_score"] = float(gold_fn(row["prompt"], row["response"]))
        except Exception as err:  # the user's judge: shown as theirs, with their frames
            raise user_code_error(
                f"the held-out judge {getattr(gold_fn, '__name__', gold_fn)}", err
            ) from None
    return rows


def _sequence_kl(policy, reference, rollout: Rollout, forward_batching: Mapping) -> torch.Tensor:
    """(B,) per-sequence sum of k1 over the policy's own tokens (the action mask).

    The policy's log-probs come from the same full forward as the reference's (not the generation's
    cached pass), so identical models give exactly 0.
    """
    logp = sequence_logprobs(policy, rollout, **forward_batching)
    logp_ref = sequence_logprobs(reference, rollout, **forward_batching)
    per_token = kl_estimate(logp, logp_ref, "k1")
    return torch.where(rollout.action_mask.bool(), per_token, 0.0).sum(dim=1).cpu()


def _means(rows: Sequence[dict]) -> dict[str, float]:
    """eval/* mean of every per-row field present in the rows, and of each reward component's score."""
    means = {
        metric: sum(float(row[key]) for row in rows) / len(rows)
        for key, metric in ROW_METRICS.items()
        if rows and key in rows[0]
    }
    for name in rows[0].get("components", {}) if rows else ():
        means[f"eval/reward/{name}/raw"] = sum(row["components"][name] for row in rows) / len(rows)
    return means


def _slice_means(rows: Sequence[dict]) -> dict[str, dict[str, float]]:
    """slice -> {"n", eval/* means} over the rows of that slice."""
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(row["slice"], []).append(row)
    return {name: {"n": len(members), **_means(members)} for name, members in sorted(groups.items())}


# --------------------------------------------------------------------------------------------------
# Comparing policies
# --------------------------------------------------------------------------------------------------


def win_rate(scores_a: Sequence[float], scores_b: Sequence[float]) -> float:
    """Fraction of paired rows where ``a`` beats ``b``; a tie counts half."""
    if len(scores_a) != len(scores_b) or not scores_a:
        raise ValueError(
            f"win_rate needs two equally long, non-empty score lists, got {len(scores_a)} and {len(scores_b)}"
        )
    wins = sum(1.0 if a > b else 0.5 if a == b else 0.0 for a, b in zip(scores_a, scores_b))
    return wins / len(scores_a)


def compare_policies(
    results: dict[str, EvalResult], baseline: str | None = None, score: str = "RM score"
) -> dict:
    """The comparison table's data: ``{"baseline", "judge", "score", "policies": {name: {metric: value}}}``.

    Every policy must have been evaluated on the same prompts in the same order. ``eval/win_rate`` of
    each non-baseline policy is against ``baseline`` (default: the first, e.g. SFT), judged by the gold
    judge when every result has gold scores, else by the run's reward (``judge`` says which; an episode's
    is its total). ``score`` is that reward's name in the table (:meth:`RewardConfig.score_name`).
    """
    if not results:
        raise ValueError("compare_policies needs at least one EvalResult")
    baseline = baseline or next(iter(results))
    if baseline not in results:
        raise LmppoError(f"baseline {baseline!r} is not among the evaluated policies {list(results)}")
    base = results[baseline]
    judge = "gold" if all("eval/gold_score" in r.metrics for r in results.values()) else "rm"
    policies = {}
    for name, result in results.items():
        policies[name] = dict(result.metrics)
        if name == baseline:
            continue
        if [row["prompt"] for row in result.rows] != [row["prompt"] for row in base.rows]:
            raise LmppoError(
                f"cannot compare {name!r} with {baseline!r}: they were evaluated on different prompts"
            )
        key = "gold_score" if judge == "gold" else reward_key(result.rows)
        policies[name]["eval/win_rate"] = win_rate([r[key] for r in result.rows], [r[key] for r in base.rows])
    return {"baseline": baseline, "judge": judge, "score": score, "policies": policies}


def reward_key(rows: Sequence[dict]) -> str:
    """The row field holding the reward: an episode's total, else the score."""
    return "total_reward" if rows and "total_reward" in rows[0] else "rm_score"


def reward_text(row: Mapping, score: str = "RM") -> str:
    """A row's reward for people: ``RM 0.5`` (``score`` names it), or an episode's total with its final and
    turn parts where both are non-zero (either alone is the total)."""
    if "total_reward" not in row:
        return f"{score} {row['rm_score']:.4g}"
    final, turn = row["rm_score"], row["turn_reward"]
    parts = f" (final {final:.4g}, turn {turn:.4g})" if final and turn else ""
    return f"reward {row['total_reward']:.4g}{parts}"


def summary_columns(summary: dict) -> list[tuple[str, str]]:
    """(metric, label) of the columns at least one policy has a value for; an episode's reward parts only
    where both are non-zero for some policy (else one of them is the total)."""
    policies = summary["policies"].values()
    present = {metric for values in policies for metric in values}
    parts = ("eval/reward/rm_score", "eval/reward/turn")
    if "eval/reward/total" in present and not all(any(p.get(m) for p in policies) for m in parts):
        present -= set(parts)
    score = summary.get("score", "RM score")  # an eval.json of before the reward's own words
    judge = "gold" if summary["judge"] == "gold" else score
    final = "final score" if "eval/reward/total" in present else score
    names = {"baseline": summary["baseline"], "judge": judge, "score": score, "final": final}
    return [(metric, label.format(**names)) for metric, label in SUMMARY_COLUMNS if metric in present]


def summary_table(summary: dict) -> Table:
    """A ``rich`` table of :func:`compare_policies`: one row per policy, '-' where a value is missing."""
    columns = summary_columns(summary)
    table = Table(title="held-out evaluation")
    table.add_column("policy")
    for _, label in columns:
        table.add_column(label, justify="right")
    for name, values in summary["policies"].items():
        table.add_row(name, *(f"{values[m]:.4g}" if m in values else "-" for m, _ in columns))
    return table


def write_eval_json(
    run_dir: str | Path, results: dict[str, EvalResult], baseline: str | None = None, score: str = "RM score"
) -> dict:
    """Write ``RUN_DIR/eval.json``: ``{"summary": compare_policies(...), "policies": {name: EvalResult}}``
    (the format is spelled out in :mod:`lmppo.runs.report`, its reader); returns the summary."""
    summary = compare_policies(results, baseline, score)
    record = {"summary": summary, "policies": {name: result.to_dict() for name, result in results.items()}}
    path = Path(run_dir) / EVAL_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    return summary


def run_engine(cfg: Config, spec: RunSpec, policy, tokenizer) -> Generator | None:
    """The run's vLLM engine (``rollout.engine: vllm``) for ``lmppo eval``, loaded from the starting policy:
    both policies sample as training did; None: the transformers decode loop on each policy."""
    if spec.engine.kind != "vllm":
        return None
    spec = replace(spec, engine=replace(spec.engine, weight_sync="merged", sleeps=False))  # final/ is whole
    return configured_vllm(cfg, spec, policy, tokenizer, dtype=spec.compute_dtype)


def evaluate_run(run_dir: str | Path, prompts_path: str | Path | None = None) -> dict:
    """``lmppo eval RUN_DIR``: the run's final policy vs its starting policy on held-out prompts.

    Uses the run's own config (decoding, reward, judge); writes ``RUN_DIR/eval.json`` for the report.
    """
    run_dir = Path(run_dir)
    cfg = load_config(run_dir / "config.yaml")
    prompts_path = prompts_path or cfg.data.eval_prompts
    if prompts_path is None:
        raise LmppoError(
            "no held-out prompts: pass --prompts FILE or set data.eval_prompts in the run's config"
        )
    if not (run_dir / "final").is_dir():
        raise LmppoError(
            f"{run_dir / 'final'} does not exist: the run has not finished (continue it with --resume)"
        )
    # On the run's device and in its numerics: both policies are frozen here (16-bit under bf16).
    spec = resolve(cfg)
    torch.set_float32_matmul_precision(spec.fp32_matmul_precision)
    start_source = frozen_policy_source(cfg, spec)
    final_source = start_source.model_copy(update={"path": str(run_dir / "final"), "gguf_file": None})
    tokenizer, prompts = (
        load_tokenizer(cfg.models.policy),
        load_prompts(prompts_path, key=cfg.data.prompt_key),
    )
    rows = load_prompt_rows(prompts_path)  # what an environment resets on
    reward_fn = load_reward(cfg.reward, spec.rewards, spec.device).reward
    gold_fn = load_function(cfg.data.eval_judge, "data.eval_judge") if cfg.data.eval_judge else None
    start, final = (load_causal_lm(source).to(spec.device) for source in (start_source, final_source))
    engine = run_engine(cfg, spec, start, tokenizer)
    results = {}
    # an offloaded reward model comes to the device for the evaluation (lmppo.modeling.quantize.offload)
    with autocast(spec.precision, spec.device), gathered(*getattr(reward_fn, "models", [])):
        for version, (name, policy) in enumerate((("start", start), ("PPO", final))):
            if engine is not None:
                engine.sync_weights(policy, version)
            generator = engine or policy_generator(cfg, spec, policy, tokenizer)
            results[name] = evaluate_policy(
                policy,
                tokenizer,
                prompts,
                reward_fn=reward_fn,
                reference=start,
                gold_fn=gold_fn,
                generator_options=generator_options(cfg),
                batch_size=cfg.run.eval_batch_size,
                seed=cfg.run.seed,
                generator=generator,
                rows=rows,
            )
    if engine is not None:
        engine.close()
    episodes = bool(cfg.rollout.environment or cfg.rollout.tools)
    return write_eval_json(run_dir, results, "start", cfg.reward.score_name(episodes))
