"""The ``lmppo`` command line: a thin typer layer over the library (no logic lives here)."""

from __future__ import annotations

import sys

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
def quickstart() -> None:
    """Run the embedded default (until the full toy pipeline lands: the seeds' worked example)."""
    import torch

    from lmppo import core

    logp_old = torch.tensor([[-1.0, -0.5, -2.0, -0.1]])
    logp_ref = torch.tensor([[-1.2, -0.5, -1.0, -0.1]])
    rewards = core.shaped_rewards(torch.tensor([1.5]), logp_old, logp_ref, torch.ones(1, 4), beta=0.1)
    print("shaped rewards of the seeds' worked example (beta=0.1):", [round(r, 4) for r in rewards[0].tolist()])
    print("The full pipeline (toy SFT -> reward model -> PPO -> evaluation -> report) is coming to this command.")
