"""The ``lmppo`` command line: a thin typer layer over the library (no logic lives here)."""

from __future__ import annotations

import dataclasses
import sys
from enum import StrEnum
from pathlib import Path

import typer
from rich.markup import escape

from lmppo.errors import Interrupted, LmppoError
from lmppo.errors import console as make_console
from lmppo.rewards.limits import Limits
from lmppo.version import __version__

app = typer.Typer(
    name="lmppo",
    help="PPO for RLHF on Hugging Face causal language models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = make_console(stderr=True)
_transformers_verbose = False  # `lmppo --verbose`, set by _root for the command that follows


def _version(value: bool) -> None:
    if value:
        print(f"lmppo {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version."
    ),
    verbose: bool = typer.Option(
        False, "--verbose", help="Leave transformers' progress bars and load reports on."
    ),
) -> None:
    """PPO for RLHF on Hugging Face causal language models."""
    global _transformers_verbose
    _transformers_verbose = verbose


def _quiet_transformers_unless_verbose() -> None:
    """Each command that loads models calls this just before, rather than `main` at start-up: help and the
    errors a config or a missing file causes then never wait seconds for transformers (and torch) to import.
    `lmppo --verbose` leaves transformers' bars and load reports on."""
    if not _transformers_verbose:
        from lmppo.modeling.loading import quiet_transformers

        quiet_transformers()


def _check_run_directory(run_dir: Path, command: str) -> None:
    """Refuse a run directory without metrics before the command imports torch to read them."""
    if not (run_dir / "metrics.jsonl").is_file():
        raise LmppoError(
            f"no {run_dir / 'metrics.jsonl'}: train first (`lmppo ppo CONFIG` or `lmppo quickstart`) so "
            f"{run_dir} is a run directory, then run `lmppo {command} {run_dir}`"
        )


def main() -> None:
    """Entry point: user errors become one paragraph and exit code 2, never a traceback."""
    try:
        app()
    except Interrupted as stop:  # saved and stopped, as asked: not an error, but not finished either
        console.print(escape(str(stop)), soft_wrap=True, highlight=False)
        sys.exit(stop.exit_code)
    except LmppoError as err:
        console.print(f"[bold red]error:[/] {escape(str(err))}", soft_wrap=True, highlight=False)
        sys.exit(err.exit_code)


def training_command(name: str, help_text: str) -> None:
    """Register `lmppo NAME CONFIG [overrides]`: one run of a config, new or resumed. `ppo` and `best-of-n`
    differ only in the algorithm a new run takes (a resumed run keeps its own)."""

    def command(
        config: Path | None = typer.Argument(
            None, help="YAML config (optional with --resume: the run's own is used)."
        ),
        overrides: list[str] | None = typer.Argument(
            None, help="section.key=value overrides, e.g. ppo.lr=1e-5"
        ),
        resume: Path | None = typer.Option(None, "--resume", help="Continue the run in this run directory."),
        allow_config_change: bool = typer.Option(
            False, "--allow-config-change", help="Resume even if the config or models differ (recorded)."
        ),
        quiet: bool = typer.Option(False, "--quiet", help="Plain log lines instead of a live display."),
        force: bool = typer.Option(
            False, "--force", help="Start even when the memory plan (`lmppo plan`) says the run does not fit."
        ),
        restore_config: bool = typer.Option(
            False,
            "--restore-config",
            help="With --resume: write a missing config.yaml back from the checkpoint.",
        ),
    ) -> None:
        _train_run(name, config, overrides, resume, allow_config_change, quiet, force, restore_config)

    app.command(name, help=help_text)(command)


training_command("ppo", "Train a policy with PPO: `lmppo ppo CONFIG section.key=value ...`.")
training_command(
    "best-of-n",
    "Rejection sampling: rounds of K samples per prompt, the best kept, SFT on the winners (the PPO config; "
    "K = rollout.samples_per_prompt, rounds = run.steps, the best_of_n section).",
)


def _train_run(
    command: str,
    config: Path | None,
    overrides: list[str] | None,
    resume: Path | None,
    allow_config_change: bool,
    quiet: bool,
    force: bool,
    restore_config: bool,
) -> None:
    """`lmppo ppo` and `lmppo best-of-n`: one run of the config, new or resumed."""
    from lmppo.inputs.config import load_config

    overrides = list(overrides or [])
    if config is not None and "=" in str(config):  # `lmppo ppo --resume RUN_DIR a.b=c`
        overrides, config = [str(config), *overrides], None
    if resume is not None:
        from lmppo.runs.run import resumed_config  # reads the checkpoint with torch

        config = config or resumed_config(resume, restore=restore_config)
        overrides.append(f"run.output_dir={resume}")
    if config is None:
        raise LmppoError(
            f"give a config file: `lmppo {command} CONFIG`, or `lmppo {command} --resume RUN_DIR`"
        )
    if quiet:
        overrides.append("logging.quiet=true")
    if resume is None:  # the command names a new run's algorithm; a resumed run keeps its own
        algorithm = command.replace("-", "_")
        asked = [o.split("=", 1)[1] for o in overrides if o.startswith("run.algorithm=")]
        if any(value != algorithm for value in asked):
            raise LmppoError(
                f"run.algorithm={asked[-1]} contradicts `lmppo {command}`, which runs {algorithm}; the command "
                f"names the algorithm: use `lmppo {asked[-1].replace('_', '-')} CONFIG ...` without the override"
            )
        overrides.append(f"run.algorithm={algorithm}")
    cfg = load_config(config, overrides)  # a bad config is refused before torch and transformers import
    steps = f"{cfg.run.steps} step{'s' * (cfg.run.steps != 1)}"
    what = "resuming" if resume is not None else "starting"
    # said at once: the imports below take seconds
    print(f"lmppo {command}: {what} {cfg.run.output_dir} ({steps})", flush=True)
    from lmppo.runs.run import train

    _quiet_transformers_unless_verbose()
    run_dir = train(
        cfg,
        resume=resume is not None,
        allow_config_change=allow_config_change,
        force=force,
    )
    console.print(f"run directory: {run_dir}")


@app.command()
def plan(
    config: Path = typer.Argument(..., help="YAML config of a PPO run."),
    overrides: list[str] | None = typer.Argument(None, help="section.key=value overrides"),
    ranks: int | None = typer.Option(None, "--ranks", help="Plan for this many torchrun ranks."),
    memory_gb: float | None = typer.Option(
        None,
        "--memory-gb",
        help="Memory of the device to plan for, GiB (default: what this machine has free).",
    ),
) -> None:
    """The run's memory per rank before it starts: models, KV cache, activations, against the device."""
    from lmppo.inputs.config import load_config

    cfg = load_config(config, list(overrides or []))
    from lmppo.runs.plan import GIB, check_startable, memory_plan, plan_report

    _quiet_transformers_unless_verbose()
    available = int(memory_gb * GIB) if memory_gb is not None else None
    make_console().print(
        plan_report(memory_plan(cfg, world_size=ranks, available=available))
    )  # stdout: a result
    check_startable(cfg)  # what `lmppo ppo` would refuse besides memory, so "fits" means it starts


def _supervised_config(config: Path, overrides: list[str] | None):
    from lmppo.inputs.config import SupervisedConfig, load_config

    return load_config(config, list(overrides or []), schema=SupervisedConfig)


@app.command()
def sft(
    config: Path = typer.Argument(
        ..., help="YAML: model, data (JSONL of prompt/response), epochs, lr, output_dir."
    ),
    overrides: list[str] | None = typer.Argument(None, help="key=value overrides, e.g. lr=1e-5"),
) -> None:
    """Supervised fine-tuning on demonstrations (response-only loss): the policy's starting point."""
    cfg = _supervised_config(config, overrides)
    from lmppo.progress import ProgressDisplay
    from lmppo.training.sft import run_sft

    _quiet_transformers_unless_verbose()
    with ProgressDisplay(0):  # the epochs and steps, live
        stats = run_sft(cfg)
    held_out = f", held-out loss {stats['eval_nll']:.4f}" if "eval_nll" in stats else ""
    console.print(
        f"SFT: {stats['steps']} steps in {stats['time_s']:.0f} s, final loss {stats['loss'][-1]:.4f}{held_out}, "
        f"{stats['trained_parameters']:,} parameters trained; saved to {cfg.output_dir}"
    )


@app.command("train-rm")
def train_rm(
    config: Path = typer.Argument(
        ..., help="YAML: model, data (JSONL of prompt/chosen/rejected), epochs, lr, ..."
    ),
    overrides: list[str] | None = typer.Argument(None, help="key=value overrides, e.g. epochs=2"),
) -> None:
    """Train a Bradley-Terry reward model on preference pairs; reports held-out accuracy per slice."""
    cfg = _supervised_config(config, overrides)
    from lmppo.progress import ProgressDisplay
    from lmppo.training.reward_modeling import run_train_rm

    _quiet_transformers_unless_verbose()
    with ProgressDisplay(0):
        stats = run_train_rm(cfg)
    accuracy = f", held-out accuracy {stats['eval']['accuracy']:.3f}" if "eval" in stats else ""
    console.print(
        f"reward model ({stats['trained_parameters']:,} parameters trained) saved to {cfg.output_dir}"
        f"{accuracy}"
    )


@app.command("eval")
def evaluate(
    run_dir: Path = typer.Argument(..., help="A finished PPO run directory (holds config.yaml and final/)."),
    prompts: Path | None = typer.Option(
        None, "--prompts", help="Held-out prompts (default: data.eval_prompts)."
    ),
) -> None:
    """Evaluate a run's final policy against its starting policy on held-out prompts (RM score, KL, win rate)."""
    from lmppo.inputs.config import load_config

    load_config(run_dir / "config.yaml")  # not a run directory: said before torch is imported
    from lmppo.runs.evaluate import evaluate_run, summary_table

    _quiet_transformers_unless_verbose()
    console.print(summary_table(evaluate_run(run_dir, prompts)))


class QuickstartTask(StrEnum):
    """``lmppo quickstart --task``: the toy world's two tasks (lmppo.interface.quickstart.TASKS)."""

    instruct = "instruct"
    tools = "tools"


@app.command()
def quickstart(
    overrides: list[str] | None = typer.Argument(
        None, help="PPO config overrides, e.g. kl.beta=0 run.steps=80"
    ),
    out: Path = typer.Option(Path("runs/quickstart"), "--out", help="Directory for every stage's output."),
    seed: int = typer.Option(0, "--seed", help="Seed of the toy world, data and training."),
    beta: float | None = typer.Option(None, "--beta", help="KL coefficient; --beta 0 shows reward hacking."),
    fast: bool = typer.Option(False, "--fast", help="The CI-sized run: less data, fewer PPO steps."),
    models_from: Path | None = typer.Option(
        None,
        "--models-from",
        help="An earlier quickstart's --out (same --seed): reuse its world, SFT policy and reward model.",
    ),
    task: QuickstartTask = typer.Option(
        QuickstartTask.instruct,
        "--task",
        help="instruct: one response per prompt, a learned reward model; tools: multi-turn episodes with "
        "a calculator the policy calls, a programmatic reward.",
    ),
) -> None:
    """The whole RLHF pipeline on the embedded toy world: SFT, reward model, PPO, evaluation, report."""
    from lmppo.interface.quickstart import run_quickstart

    _quiet_transformers_unless_verbose()
    overrides = list(overrides or [])
    if beta is not None:
        overrides.append(f"kl.beta={beta}")
    run_quickstart(out, seed=seed, fast=fast, overrides=overrides, models_from=models_from, task=task.value)


@app.command()
def init(
    output: Path = typer.Argument(Path("lmppo.yaml"), help="Where to write the config."),
    policy: str | None = typer.Option(None, "--policy", help="The model to train (an SFT checkpoint)."),
    prompts: str | None = typer.Option(
        None, "--prompts", help="Prompts: JSONL, Parquet, CSV, a saved dataset directory or a hub name."
    ),
    prompt_key: str | None = typer.Option(None, "--prompt-key", help="The column holding each prompt."),
    reward_model: str | None = typer.Option(None, "--reward-model", help="A learned reward model."),
    reward_function: str | None = typer.Option(
        None, "--reward-function", help="A reward function: module:function or file.py:function."
    ),
    reward_url: str | None = typer.Option(None, "--reward-url", help="A reward server (lmppo serve-rm)."),
    environment: str | None = typer.Option(
        None, "--environment", help="Episodes: an environment class, file.py:Class or module:Class."
    ),
    tools: list[str] = typer.Option(
        [],
        "--tools",
        help="A tool the policy may call (repeat for more): file.py:function, module:function, "
        "mcp:<server command> or an MCP server's URL.",
    ),
    run_dir: str = typer.Option("runs/my_run", "--run-dir", help="The run's output directory."),
    device: str | None = typer.Option(
        None, "--device", help="Size for cpu or cuda (default: this machine's)."
    ),
    force: bool = typer.Option(False, "--force", help="Overwrite OUTPUT if it exists."),
) -> None:
    """Write a commented starter config for your policy, reward and prompts (and environment or tools),
    sized for this machine."""
    from lmppo.interface.starter import StarterAnswers, commented_yaml, sized_starter

    if output.exists() and not force:
        raise LmppoError(f"{output} exists; choose another path or pass --force to overwrite it")
    episodes = environment is not None or bool(tools)
    if not (reward_model or reward_function or reward_url or episodes) and sys.stdin.isatty():
        reward_function = typer.prompt(
            "reward function (module:function or file.py:function; empty: a model)", ""
        )
        reward_model = None if reward_function else typer.prompt("reward model directory")
    answers = StarterAnswers(
        policy=policy or _asked("--policy", "policy model (an SFT checkpoint directory)"),
        prompts=prompts or _asked("--prompts", "prompt file"),
        reward_model=reward_model,
        reward_function=reward_function or None,
        reward_url=reward_url,
        prompt_key=prompt_key,
        output_dir=run_dir,
        environment=environment,
        tools=tools,
    )
    starter = sized_starter(answers, device)
    output.write_text(commented_yaml(starter))
    console.print(f"wrote {output}: {starter.summary}")
    console.print(f"next: lmppo plan {output}   then   lmppo ppo {output}")


def _asked(flag: str, what: str) -> str:
    """A starter answer from the terminal, or an error naming its flag when there is no terminal."""
    if not sys.stdin.isatty():
        raise LmppoError(f"lmppo init needs the {what}: pass {flag}")
    return typer.prompt(what)


LIMITS = Limits()  # serve-rm's defaults


@app.command("serve-rm")
def serve_rm(
    model: str = typer.Argument(..., help="A reward model: a transformers directory or a .gguf file."),
    port: int = typer.Option(8000, "--port", help="Port to listen on."),
    host: str = typer.Option(
        "127.0.0.1", "--host", help="Address to listen on (0.0.0.0: every interface; set a --token then)."
    ),
    batch_size: int = typer.Option(16, "--batch-size", help="Rows per forward pass."),
    chat_template: Path | None = typer.Option(
        None, "--chat-template", help="A Jinja file overriding the tokenizer's chat template."
    ),
    token: str | None = typer.Option(
        None, "--token", envvar="LMPPO_REWARD_TOKEN", help="Bearer token every request must carry."
    ),
    max_body_mb: float = typer.Option(
        LIMITS.max_body_bytes / 2**20, "--max-body-mb", help="Size one request's body may have, MiB."
    ),
    max_bodies_mb: float = typer.Option(
        LIMITS.max_bodies_bytes / 2**20,
        "--max-bodies-mb",
        help="Size of all bodies being received at once, MiB; more get 503.",
    ),
    max_values: int = typer.Option(
        LIMITS.max_values, "--max-values", help="JSON values one request's body may make."
    ),
    max_rows: int = typer.Option(LIMITS.max_rows, "--max-rows", help="Rows one request may hold."),
    max_messages: int = typer.Option(
        LIMITS.max_messages, "--max-messages", help="Messages one conversation may hold."
    ),
    max_chars: int = typer.Option(
        LIMITS.max_chars, "--max-chars", help="Characters one row may have (all its texts)."
    ),
    max_request_chars: int = typer.Option(
        LIMITS.max_request_chars,
        "--max-request-chars",
        help="Characters one request may have (all its rows).",
    ),
    queue: int = typer.Option(
        LIMITS.queue, "--queue", help="Requests that may wait for the model; more get 503."
    ),
    connections: int = typer.Option(
        LIMITS.connections, "--connections", help="Connections open at once, in all."
    ),
    connections_per_client: int = typer.Option(
        LIMITS.connections_per_client,
        "--connections-per-client",
        help="Connections open at once from one address; more get 429.",
    ),
    timeout_s: float = typer.Option(
        LIMITS.timeout_s, "--timeout-s", help="Seconds a request's body may take to arrive."
    ),
    idle_s: float = typer.Option(
        LIMITS.idle_s,
        "--idle-s",
        help="Seconds a whole request head may take, from connecting or the last answer.",
    ),
) -> None:
    """Serve a reward model over HTTP for `reward.url` (the wire format, limits and exposure: docs/rewards.md)."""
    from lmppo.rewards.reward_server import require_serving_stack, serve

    require_serving_stack()
    if chat_template is not None and not chat_template.is_file():
        raise LmppoError(f"--chat-template {chat_template}: no such file; give a Jinja template file")
    _quiet_transformers_unless_verbose()
    limits = Limits(  # the flags are named as the limits are, but for the two sizes given in MiB
        max_body_bytes=int(max_body_mb * 2**20),
        max_bodies_bytes=int(max_bodies_mb * 2**20),
        **{name: value for name, value in locals().items() if name in dataclasses.asdict(LIMITS)},
    )
    template = chat_template.read_text() if chat_template else None
    serve(model, host, port, batch_size=batch_size, chat_template=template, token=token, limits=limits)


@app.command("check-rm")
def check_rm(
    config: Path = typer.Argument(..., help="YAML config of a PPO run (its policy, reward and prompts)."),
    overrides: list[str] | None = typer.Argument(None, help="section.key=value overrides"),
) -> None:
    """The reward pre-flight without training: how the reward scores the starting policy's own samples
    (distribution, per slice, correlation with length and with ending on EOS)."""
    from lmppo.inputs.config import load_config

    cfg = load_config(config, list(overrides or []))
    from lmppo.runs.preflight import check_rm, preflight_tables, summary_line

    _quiet_transformers_unless_verbose()
    preflight, bias = check_rm(cfg)
    out = make_console()  # stdout: a result
    for table in preflight_tables(preflight):
        out.print(table)
    print(summary_line(preflight))
    print(f"- {bias}" if bias else "no length or EOS bias past the diagnosis thresholds")


data_app = typer.Typer(help="Prompt files from tasks users already have.", no_args_is_help=True)
app.add_typer(data_app, name="data")


@data_app.command("reasoning-gym")
def data_reasoning_gym(
    task: str = typer.Argument(..., help="A reasoning-gym task, or several joined by commas (a composite)."),
    config: list[str] = typer.Option(
        [], "--config", help="A task setting key=value (task.key=value in a composite); repeat for more."
    ),
    size: int = typer.Option(..., "--size", help="Rows to write."),
    seed: int = typer.Option(..., "--seed", help="Seed of the rows; a held-out file takes another one."),
    out: Path = typer.Option(..., "--out", help="The JSONL file to write."),
) -> None:
    """Write reasoning-gym prompt rows (scored by `rollout.environment: lmppo.rewards.tasks:ReasoningGym`)."""
    from lmppo.inputs.tasks import reasoning_gym_rows, write_rows

    write_rows(reasoning_gym_rows(task, config, size, seed), out)
    console.print(f"{out}: {size} rows of {task}, seed {seed}")


@data_app.command("textarena")
def data_textarena(
    game: str = typer.Argument(..., help="A textarena game id, e.g. TicTacToe-v0."),
    size: int = typer.Option(..., "--size", help="Rows (games) to write."),
    seed: int = typer.Option(0, "--seed", help="Seed of the games; a held-out file takes another one."),
    out: Path = typer.Option(..., "--out", help="The JSONL file to write."),
) -> None:
    """Write textarena prompt rows: each game's first observation and its game_seed (played by
    `rollout.environment: textarena:GAME`)."""
    from lmppo.inputs.tasks import write_rows
    from lmppo.sampling.textarena_envs import textarena_rows

    write_rows(textarena_rows(game, size, seed), out)
    console.print(f"{out}: {size} games of {game}, seed {seed}")


@app.command()
def diagnose(run_dir: Path = typer.Argument(..., help="A run directory (holds metrics.jsonl).")) -> None:
    """Read a run's metrics against the known PPO failure modes: evidence, likely cause, what to change."""
    _check_run_directory(run_dir, "diagnose")
    from lmppo.runs.diagnose import diagnose_run

    findings = diagnose_run(run_dir)
    for finding in findings:
        print(f"- {finding}")  # stdout: a result
    if not findings:
        print(f"{run_dir}: no known failure mode in its metrics")


@app.command()
def report(
    run_dir: Path = typer.Argument(..., help="A run directory (holds metrics.jsonl)."),
    compare: list[Path] | None = typer.Option(None, "--compare", help="Other runs to overlay on the curves."),
) -> None:
    """Write the HTML report (plots, evaluation, samples) of a run into RUN_DIR/report/."""
    for directory in [run_dir, *(compare or [])]:
        _check_run_directory(directory, "report")
    from lmppo.runs.report import report as write_report

    console.print(f"report: {write_report(run_dir, compare=compare or [])}")
