"""The README is a guide that works: every command in it exists with the options it uses, its Python
runs, its YAML is a valid config, its links resolve, and it stays short."""

import re
import shlex
from pathlib import Path

import click
import typer
import yaml

from lmppo.inputs.config import validate_config
from lmppo.interface.cli import app

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


def commands() -> list[list[str]]:
    lines = [line.split("  #")[0].strip() for block in blocks("bash") for line in block.splitlines()]
    return [shlex.split(line) for line in lines if line]


def lmppo_arguments(words: list[str]) -> list[str] | None:
    """The words after `lmppo` (or torchrun's `-m lmppo`), else None."""
    if words[0] == "lmppo":
        return words[1:]
    if words[0] == "torchrun" and "lmppo" in words:
        return words[words.index("lmppo") + 1 :]
    return None


def test_every_lmppo_command_in_the_readme_exists_with_the_options_it_uses():
    group = typer.main.get_command(app)
    seen = 0
    for words in commands():
        arguments = lmppo_arguments(words)
        if arguments is None:
            continue
        command = group.get_command(click.Context(group), arguments[0])
        assert command is not None, f"README: `lmppo {arguments[0]}` is no command"
        options = {opt for param in command.params for opt in getattr(param, "opts", [])}
        for word in arguments[1:]:
            if word.startswith("--"):
                assert word.split("=")[0] in options, f"README: `lmppo {arguments[0]}` has no option {word}"
        seen += 1
    assert seen >= 5


def test_every_make_target_and_script_in_the_readme_exists():
    makefile = (ROOT / "Makefile").read_text()
    for words in commands():
        if words[0] == "make":
            assert re.search(rf"^{words[1]}:", makefile, flags=re.M), f"README: no make target {words[1]}"
        if words[0] in ("python", "bash"):
            assert (ROOT / words[1]).is_file(), f"README: no file {words[1]}"


def test_the_readme_yaml_is_a_valid_config():
    (config,) = blocks("yaml")
    cfg = validate_config(yaml.safe_load(config), source="the README's config")  # raises when invalid
    # what the README's comments say about it
    assert cfg.models.policy_lora.enabled and cfg.models.value.mode == "shared"
    assert cfg.reward.model.path == "path/to/reward_model" and cfg.data.eval_prompts == "held_out.jsonl"


def test_the_readme_python_runs_and_trains(run_files, monkeypatch):
    (code,) = blocks("python")
    monkeypatch.chdir(run_files.parent)
    runnable = code.replace("runs/quickstart/sft", "policy").replace('"steps": 20', '"steps": 1')
    namespace = {}
    exec(compile(runnable, "README.md", "exec"), namespace)  # noqa: S102 - the README's own example
    assert namespace["result"].metrics[-1]["step"] == 1
    assert type(namespace["policy"]).__name__ == "LlamaForCausalLM"


def test_the_readme_links_resolve_and_it_stays_a_short_guide():
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README):
        if not target.startswith("http"):
            assert (ROOT / target).exists(), f"README links to {target}, which does not exist"
    assert len(README.splitlines()) <= 200
