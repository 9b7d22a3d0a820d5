"""``lmppo quickstart``: the classic RLHF pipeline on the embedded toy world, end to end on a CPU.

toy world (tokenizers + tiny Llamas + data, from a seed) -> SFT on noisy demonstrations -> Bradley-Terry
reward model (started from the SFT transformer, InstructGPT-style) on gold-judge-labelled pairs -> PPO
(policy from SFT, reference = SFT, critic from the RM) -> held-out evaluation of SFT and PPO with the RM
and the hidden gold judge -> HTML report. ``--beta 0`` shows reward hacking: RM score up, gold down, until a
guard stops the run and the diagnosis names over-optimisation (the report is written all the same).
Settings live in ``lmppo/toy/quickstart.yaml``.

``--task tools`` runs the same stages on the tools world (:mod:`lmppo.toy.tools`): SFT on demonstrated
episodes, no reward model (the reward is the calculator's answer key, programmatic), PPO on multi-turn
episodes with a calculator, and the held-out evaluation playing episodes too
(``lmppo/toy/quickstart_tools.yaml``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import yaml

from lmppo.errors import GuardAbort, LmppoError
from lmppo.errors import console as make_console
from lmppo.inputs.config import QuickstartConfig, TrainingStage, apply_override, validate_config
from lmppo.inputs.data import Prompt, load_demonstrations, read_jsonl
from lmppo.inputs.resolve import check_sections, resolve
from lmppo.modeling.loading import load_causal_lm, load_tokenizer
from lmppo.modeling.models import PPOModels
from lmppo.runs.build import generator_options, load_reward, policy_generator
from lmppo.runs.evaluate import EvalResult, GoldJudge, evaluate_policy, summary_table, write_eval_json
from lmppo.runs.report import report
from lmppo.runs.run import train
from lmppo.toy import task, tools
from lmppo.toy.models import ToyWorld, build_toy_world, load_toy_world, reward_model_from_policy
from lmppo.training.reward_modeling import evaluate_reward_model, train_reward_model, write_rm_eval_json
from lmppo.training.sft import train_sft

console = make_console()
STAGE_SECTIONS = ("sft", "reward_model")  # override prefixes that address a stage, not the PPO run


@dataclass(frozen=True)
class ToyTask:
    """What differs between the quickstart's two toy tasks."""

    name: str  # lmppo.toy.models.TASKS
    settings: str  # the file in lmppo/toy/
    gold: GoldJudge  # the hidden judge of the held-out evaluation
    kind: Callable[[Prompt], str]  # a prompt's slice in the evaluation
    fast_data: dict[str, int]  # --fast: the CI-sized run (less data, fewer epochs and PPO steps)
    fast_overrides: tuple[str, ...]


TASKS = {
    "instruct": ToyTask(
        "instruct",
        "quickstart.yaml",
        task.gold_score,
        lambda prompt: task.task_of(prompt).kind,
        {"sft_train": 1200, "sft_test": 100, "prefs_train": 1200, "prefs_test": 200, "prompts_test": 64},
        ("sft.epochs=6", "reward_model.epochs=5", "run.steps=20", "run.eval_every=0"),
    ),
    "tools": ToyTask(
        "tools",
        "quickstart_tools.yaml",
        tools.gold_score,
        lambda prompt: tools.sum_of(prompt).kind,
        {"sft_train": 1200, "sft_test": 100, "prompts_test": 64},
        ("sft.epochs=12", "run.steps=20", "run.eval_every=0"),
    ),
}


def quickstart_config(
    out_dir: Path, models_dir: Path, world, overrides: list[str], settings: str = "quickstart.yaml"
) -> QuickstartConfig:
    """The packaged ``settings`` with this run's paths (the SFT and RM under ``models_dir``), then the user's
    overrides (PPO keys need no prefix); the PPO run's sections checked against each other before a stage
    trains."""
    raw = yaml.safe_load(resources.files("lmppo.toy").joinpath(settings).read_text())
    paths = [
        f"models.policy.path={models_dir / 'sft'}",
        *([f"reward.model.path={models_dir / 'rm'}"] if world.reward_tokenizer_dir else []),
        f"data.prompts={world.data['prompts_train']}",
        f"data.ptx_demonstrations={world.data['sft_train']}",  # read only when ppo.ptx_coef > 0
        f"run.output_dir={out_dir / 'ppo'}",
    ]
    for override in [*paths, *overrides]:
        stage = override.split(".", 1)[0] in STAGE_SECTIONS
        apply_override(raw, override if stage else f"ppo_run.{override}")
    cfg = validate_config(raw, source="quickstart settings", schema=QuickstartConfig)
    check_sections(cfg.ppo_run)
    return cfg


def train_sft_and_reward_model(
    out_dir: Path, world: ToyWorld, cfg: QuickstartConfig, seed: int
) -> dict | None:
    """Stages 2 and 3: the SFT policy (``out_dir/sft``) and the reward model (``out_dir/rm``); returns the
    RM's held-out evaluation (None: the task's reward is programmatic, no RM)."""
    with console.status("[2/6] SFT on noisy demonstrations"):
        tokenizer = load_tokenizer(world.policy_dir)
        policy = load_causal_lm(world.policy_dir)
        demonstrations = load_demonstrations(world.data["sft_train"])
        sft = train_sft(
            policy,
            tokenizer,
            [{"prompt": prompt, "response": response} for prompt, response in demonstrations],
            epochs=cfg.sft.epochs,
            lr=cfg.sft.lr,
            batch_size=cfg.sft.batch_size,
            seed=seed,
        )
        policy.save_pretrained(out_dir / "sft")
        tokenizer.save_pretrained(out_dir / "sft")
    console.print(f"[2/6] SFT: {sft['steps']} steps, final loss {sft['loss'][-1]:.3f}, {sft['time_s']:.0f} s")
    if cfg.reward_model is None:
        console.print(f"[3/6] reward: {cfg.ppo_run.reward.function} (programmatic), no reward model to train")
        return None

    with console.status("[3/6] reward model: Bradley-Terry on preference pairs, from the SFT transformer"):
        rm, rm_tokenizer, rm_stats = train_toy_reward_model(
            policy, world, cfg.reward_model, seed, out_dir / "rm"
        )
        rm_eval = evaluate_reward_model(rm, rm_tokenizer, read_jsonl(world.data["prefs_test"]))
    console.print(
        f"[3/6] reward model: held-out accuracy {rm_eval['accuracy']:.3f} ({rm_stats['time_s']:.0f} s)"
    )
    return rm_eval


def train_toy_reward_model(policy, world: ToyWorld, stage: TrainingStage, seed: int, out: Path):
    """The reward model stage: the policy's transformer with a new score head (``seed``), trained on the
    world's preference pairs and saved to ``out``; returns the model, its tokenizer and the training stats."""
    rm_tokenizer = load_tokenizer(world.reward_tokenizer_dir)
    rm = reward_model_from_policy(policy, rm_tokenizer, seed=seed)
    pairs = read_jsonl(world.data["prefs_train"])
    stats = train_reward_model(
        rm, rm_tokenizer, pairs, epochs=stage.epochs, lr=stage.lr, batch_size=stage.batch_size, seed=seed
    )
    rm.save_pretrained(out)
    rm_tokenizer.save_pretrained(out)
    return rm, rm_tokenizer, stats


def prepare_world(
    out_dir: Path, models_dir: Path, toy: ToyTask, *, reuse: bool, seed: int, fast: bool, overrides: list[str]
) -> tuple[ToyWorld, QuickstartConfig]:
    """Stage 1: the toy world of ``toy``'s task (built afresh, or with ``reuse`` the one whose models
    ``models_dir`` holds) and the config."""
    if (out_dir / "ppo").exists():
        raise LmppoError(f"{out_dir} already holds a quickstart run; remove it or pass --out NEW_DIR")
    if reuse and not (models_dir / "ppo" / "quickstart.json").is_file():
        raise LmppoError(f"{models_dir} holds no finished quickstart to reuse; run one there first")
    with console.status("[1/6] building the toy world: tokenizers, tiny Llamas, data"):
        if not reuse:
            sizes = toy.fast_data if fast else None
            world = build_toy_world(out_dir / "world", seed=seed, sizes=sizes, task=toy.name)
        else:  # the same seed's world: its SFT policy and RM were trained on it
            world = load_toy_world(models_dir / "world")
        overrides = [*(toy.fast_overrides if fast else ()), *overrides]
        cfg = quickstart_config(out_dir, models_dir, world, overrides, toy.settings)
        cfg.ppo_run.run.seed = seed
    console.print(f"[1/6] toy world in {models_dir / 'world'}")
    return world, cfg


def run_quickstart(
    out_dir: str | Path = "runs/quickstart",
    *,
    seed: int = 0,
    fast: bool = False,
    overrides: list[str] = (),
    models_from: str | Path | None = None,
    task: str = "instruct",
) -> dict:
    """Run every stage; returns the evaluation summary (also printed and written to the run).

    ``models_from``: the directory of an earlier quickstart of the same seed and task whose world, SFT
    policy and reward model this run reuses (stages 1-3 skipped): PPO settings compared on the same models.
    ``task``: ``instruct`` (the instruction task, a learned reward model) or ``tools`` (multi-turn episodes
    with a calculator, a programmatic reward).
    """
    out_dir, started, toy = Path(out_dir), time.perf_counter(), TASKS[task]
    models_dir = Path(models_from) if models_from is not None else out_dir
    reuse = models_from is not None
    world, cfg = prepare_world(
        out_dir, models_dir, toy, reuse=reuse, seed=seed, fast=fast, overrides=overrides
    )
    if models_from is None:
        rm_eval = train_sft_and_reward_model(out_dir, world, cfg, seed)
    else:
        rm_eval = json.loads((models_dir / "ppo" / "quickstart.json").read_text()).get("rm_eval")
        console.print(f"[2-3/6] SFT policy and reward model of {models_dir}")
    evaluate = held_out_evaluation(cfg.ppo_run, world, toy, load_tokenizer(models_dir / "sft"))
    run_dir = train_ppo(cfg.ppo_run, evaluate, rm_eval)

    with console.status("[5/6] held-out evaluation of SFT and PPO"):
        sft_policy = load_causal_lm(models_dir / "sft")
        ppo_policy = load_causal_lm(run_dir / "final")
        spec = resolve(cfg.ppo_run)
        scorer = load_reward(cfg.ppo_run.reward, spec.rewards, spec.device).reward  # as in PPO
        results = {
            "SFT": evaluate(sft_policy, sft_policy, scorer),  # the reference is the SFT policy itself
            "PPO": evaluate(ppo_policy, sft_policy, scorer),
        }
        score = "RM score" if cfg.ppo_run.reward.learned else "reward"
        summary = write_eval_json(run_dir, results, baseline="SFT", score=score)
    console.print("[5/6] held-out evaluation")
    console.print(summary_table(summary))

    finish(run_dir, started, seed, rm_eval, summary)
    return summary


def held_out_evaluation(ppo_cfg, world: ToyWorld, toy: ToyTask, tokenizer) -> Callable[..., EvalResult]:
    """``evaluate(policy, reference, reward)``: the held-out prompts sampled as training samples (episodes
    with the task's environment, if it has one), judged by the reward and the hidden gold judge."""
    rows = read_jsonl(world.data["prompts_test"])
    prompts = [row["prompt"] for row in rows]
    demonstrations = [{"prompt": p, "response": r} for p, r in load_demonstrations(world.data["sft_test"])]
    spec = resolve(ppo_cfg)

    def evaluate(policy, reference, reward) -> EvalResult:
        return evaluate_policy(
            policy,
            tokenizer,
            prompts,
            reward_fn=reward,
            reference=reference,
            gold_fn=toy.gold,
            demonstrations=demonstrations,
            slices=[toy.kind(prompt) for prompt in prompts],
            generator_options=generator_options(ppo_cfg),
            batch_size=ppo_cfg.run.eval_batch_size,
            seed=ppo_cfg.run.seed,
            generator=policy_generator(ppo_cfg, spec, policy, tokenizer),
            rows=rows,
        )

    return evaluate


def train_ppo(ppo_cfg, evaluate: Callable[..., EvalResult], rm_eval: dict | None) -> Path:
    """Stage 4: the PPO run, with the held-out evaluation every ``run.eval_every`` steps; its directory."""
    console.print(
        f"[4/6] PPO: {ppo_cfg.run.steps} steps of {ppo_cfg.rollout.batch_size} prompts, "
        f"beta {ppo_cfg.kl.beta}"
    )

    def periodic_eval(models: PPOModels):
        return lambda: evaluate(models.policy, models.reference, models.reward).metrics

    try:
        run_dir = train(ppo_cfg, evaluator_factory=periodic_eval)
    except GuardAbort as abort:  # the run stopped itself: its report still shows why
        if rm_eval is not None:
            write_rm_eval_json(abort.run_dir, rm_eval)
        raise GuardAbort(
            f"{abort}\nThe report of the stopped run: {report(abort.run_dir)}", abort.run_dir
        ) from None
    if rm_eval is not None:
        write_rm_eval_json(run_dir, rm_eval)
    return run_dir


def finish(run_dir: Path, started: float, seed: int, rm_eval: dict | None, summary: dict) -> None:
    """Stage 6: the report, and ``quickstart.json`` (minutes, seed, the RM's accuracy and held-out
    evaluation, the policies' evaluation summary)."""
    html = report(run_dir)
    minutes = (time.perf_counter() - started) / 60
    accuracy = rm_eval and rm_eval["accuracy"]
    record = {
        "minutes": minutes,
        "seed": seed,
        "rm_accuracy": accuracy,
        "rm_eval": rm_eval,
        "summary": summary,
    }
    (run_dir / "quickstart.json").write_text(json.dumps(record, indent=2))
    console.print(f"[6/6] report: {html}\nquickstart took {minutes:.1f} min")
