"""The ``lmppo`` command line: a thin typer layer over the library (no logic lives here)."""

from __future__ import annotations

import sys
from pathlib import Path

import typer
from rich.console import Console

from lmppo import __version__
from lmppo.errors import LmppoError

app = typer.Typer(
    name="lmppo",
    help="PPO for RLHF on Hugging Face causal language models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console(stderr=True)


def _version(value: bool) -> None:
    if value:
        print(f"lmppo {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    """PPO for RLHF on Hugging Face causal language models."""


def main() -> None:
    """Entry point: user errors become one paragraph and exit code 2, never a traceback."""
    try:
        app()
    except LmppoError as err:
        console.print(f"[bold red]error:[/] {err}")
        sys.exit(2)



@app.command()
def ppo(
    config: Path | None = typer.Argument(None, help="YAML config (optional with --resume: the run's own is used)."),
    overrides: list[str] | None = typer.Argument(None, help="section.key=value overrides, e.g. ppo.lr=1e-5"),
    resume: Path | None = typer.Option(None, "--resume", help="Continue the run in this run directory."),
    allow_config_change: bool = typer.Option(
        False, "--allow-config-change", help="Resume even if the config or models differ (recorded)."),
    quiet: bool = typer.Option(False, "--quiet", help="Plain log lines instead of a live display."),
) -> None:
    """Train a policy with PPO: `lmppo ppo CONFIG section.key=value ...`."""
    from lmppo.config import load_config
    from lmppo.trainer import train

    overrides = list(overrides or [])
    if config is not None and "=" in str(config):  # `lmppo ppo --resume RUN_DIR a.b=c`
        overrides, config = [str(config), *overrides], None
    if resume is not None:
        config = config or resume / "config.yaml"
        overrides.append(f"run.output_dir={resume}")
    if config is None:
        raise LmppoError("give a config file: `lmppo ppo CONFIG`, or `lmppo ppo --resume RUN_DIR`")
    if quiet:
        overrides.append("logging.quiet=true")
    run_dir = train(load_config(config, overrides), resume=resume is not None, allow_config_change=allow_config_change)
    console.print(f"run directory: {run_dir}")


@app.command()
def quickstart() -> None:
    """Run the embedded default (until the full toy pipeline lands: the seeds' worked example)."""
    import torch

    from lmppo import core

    logp_old = torch.tensor([[-1.0, -0.5, -2.0, -0.1]])
    logp_ref = torch.tensor([[-1.2, -0.5, -1.0, -0.1]])
    rewards = core.shaped_rewards(torch.tensor([1.5]), logp_old, logp_ref, torch.ones(1, 4), beta=0.1)
    print("shaped rewards of the seeds' worked example (beta=0.1):", [round(r, 4) for r in rewards[0].tolist()])
    print("The full pipeline (toy SFT -> reward model -> PPO -> evaluation -> report) is coming to this command.")
