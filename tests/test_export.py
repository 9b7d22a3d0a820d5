"""What a run leaves (lmppo.runs.export): the critic saved beside the policy predicts what the trained one
did, and a new run starts from it, by models.value.path or by itself on the exported policy."""

import json
from dataclasses import replace

import pytest
import torch
from helpers import INPUT_IDS, run_cli, write_config
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import lmppo
from lmppo.errors import LmppoError
from lmppo.inputs.config import load_config
from lmppo.inputs.resolve import resolve
from lmppo.modeling.models import ValueModel, make_value_model
from lmppo.runs.checkpoint import latest_checkpoint, load_checkpoint
from lmppo.runs.export import checkpoint_group, plain_policy, starting_critic

CRITICS = {
    "separate": [],
    "separate LoRA": ["models.value.lora.enabled=true"],
    "shared": ["models.value.mode=shared"],
}


def values(critic: ValueModel) -> torch.Tensor:
    positions = torch.arange(INPUT_IDS.shape[1]).expand_as(INPUT_IDS)
    with torch.no_grad():
        return critic(INPUT_IDS, torch.ones_like(INPUT_IDS), positions)


def trained_critic(spec, run_dir) -> ValueModel:
    """The critic as training left it: the last checkpoint's weights over the critic the run started with."""
    checkpoint = load_checkpoint(latest_checkpoint(run_dir))
    weights = checkpoint_group(checkpoint, "value")
    if spec.value.shares:
        critic = ValueModel.shared_trunk(plain_policy(spec, checkpoint_group(checkpoint, "policy"), "test"))
    else:
        critic = starting_critic(spec)
    assert not critic.load_state_dict(weights, strict=False).unexpected_keys
    return critic


@pytest.mark.parametrize("kind", CRITICS)
def test_the_saved_critic_predicts_what_the_trained_one_did(run_files, kind):
    assert run_cli("ppo", str(run_files), *CRITICS[kind]) == 0
    run_dir, saved = run_files.parent / "run", run_files.parent / "run" / "final" / "value"
    record = json.loads((saved / "value.json").read_text())
    assert record["mode"] == ("shared" if kind == "shared" else "separate") and record["step"] == 2
    assert (saved / "config.json").is_file() == (kind != "shared")  # a shared critic's trunk is final/
    assert "Critic: in `value/`" in (run_dir / "final" / "README.md").read_text()

    spec = resolve(load_config(run_files, CRITICS[kind]), device="cpu")
    reloaded_role = replace(spec.value, saved=str(saved), init_from=None)
    exported_policy = AutoModelForCausalLM.from_pretrained(run_dir / "final")
    reloaded = make_value_model(reloaded_role, exported_policy, None)
    trained = values(trained_critic(spec, run_dir))
    assert trained.abs().max() > 1e-4  # trained: not the zero head it started as
    torch.testing.assert_close(values(reloaded), trained, rtol=1e-4, atol=1e-5)


def test_a_run_on_an_exported_policy_starts_its_critic_from_the_one_saved_beside_it(run_files):
    assert run_cli("ppo", str(run_files)) == 0
    first = run_files.parent / "run" / "final"
    almost_frozen = {"lr": 1e-12, "ppo_epochs": 1}  # Adam moves each weight by about lr: the start shows
    second = write_config(
        run_files,
        models={"policy": {"path": str(first)}, "value": {"init_from": "policy"}},
        ppo=almost_frozen,
        run={"steps": 1, "output_dir": str(run_files.parent / "second"), "precision": "fp32"},
    )
    assert run_cli("ppo", str(second)) == 0
    manifest = load_checkpoint(latest_checkpoint(run_files.parent / "second")).manifest
    assert manifest["identities"]["value"]["init_from"] == "saved"
    assert manifest["identities"]["value"]["saved"]["path"] == str(first / "value")
    head = load_file(first / "value" / "value_head.safetensors")
    again = load_file(run_files.parent / "second" / "final" / "value" / "value_head.safetensors")
    assert head["weight"].abs().max() > 1e-4  # a new critic's head would start at zero
    torch.testing.assert_close(again["weight"], head["weight"], rtol=0, atol=1e-8)


def test_the_python_api_starts_a_critic_from_models_value_path_and_refuses_another_mode(run_files):
    assert run_cli("ppo", str(run_files)) == 0
    saved = run_files.parent / "run" / "final" / "value"
    result = lmppo.train(
        run_files,
        overrides=[
            f"models.value.path={saved}",
            "ppo.lr=1e-12",
            "ppo.ppo_epochs=1",
            "run.steps=1",
            f"run.output_dir={run_files.parent / 'api'}",
        ],
    )
    manifest = load_checkpoint(latest_checkpoint(result.run_dir)).manifest
    assert manifest["identities"]["value"]["saved"]["path"] == str(saved)
    elsewhere = f"run.output_dir={run_files.parent / 'refused'}"
    with pytest.raises(LmppoError, match="holds a separate critic.*models.value.mode=separate"):
        lmppo.train(
            run_files, overrides=[f"models.value.path={saved}", "models.value.mode=shared", elsewhere]
        )
    with pytest.raises(LmppoError, match="no critic saved by lmppo there"):
        lmppo.train(run_files, overrides=[f"models.value.path={run_files.parent}", elsewhere])
    assert not (run_files.parent / "refused").exists()  # refused before anything was written
