import errno
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from lmppo.errors import LmppoError
from lmppo.runs.checkpoint import (
    RESUMABLE_KEYS,
    capture_rng_state,
    check_compatible,
    flatten_state,
    last_good_checkpoint,
    latest_checkpoint,
    load_checkpoint,
    load_intact_checkpoint,
    restore_rng_state,
    save_checkpoint,
    shard_scratch_dir,
    unflatten_state,
    write_tensor_groups,
)

CONFIG = {"ppo": {"lr": 1e-5, "clip_eps": 0.2}, "run": {"steps": 100, "seed": 0}, "logging": {"quiet": False}}
IDENTITIES = {"policy": {"path": "sft", "sha256": "aa"}, "reward": {"path": "rm", "sha256": "bb"}}
MANIFEST = {"config": CONFIG, "identities": IDENTITIES, "world_size": 1}


def _save(run_dir, step, tag="ok", keep_last=10, tensors=None, state=None):
    tensors = tensors if tensors is not None else {"policy": {"w": torch.full((4, 4), float(step))}}
    state = state if state is not None else {"step": step, "cursor": [step, 3]}
    return save_checkpoint(
        run_dir / "checkpoints",
        step,
        tensors=tensors,
        state=state,
        manifest=MANIFEST,
        tag=tag,
        keep_last=keep_last,
    )


def _assert_same(a, b):
    """Structural equality, including container types, tensor dtypes and bit-exact tensor values."""
    assert type(a) is type(b), (a, b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            _assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    else:
        assert a == b


def _through_disk(tmp_path, tensors, skeleton):
    """What a checkpoint does to a flattened state: tensors via safetensors, skeleton via JSON."""
    save_file(tensors, tmp_path / "t.safetensors")
    return load_file(tmp_path / "t.safetensors"), json.loads(json.dumps(skeleton))


def _model_and_optimizer(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _train(model, optimizer, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        loss = model(torch.randn(8, 5, generator=gen)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


# --------------------------------------------------------------------------------------------------
# flatten_state / RNG
# --------------------------------------------------------------------------------------------------


def test_adamw_state_round_trips_bit_exactly_and_training_continues_identically(tmp_path):
    model, optimizer = _model_and_optimizer(0)
    _train(model, optimizer, 3, seed=1)
    tensors, skeleton = _through_disk(tmp_path, *flatten_state(optimizer.state_dict()))
    restored_state = unflatten_state(tensors, skeleton)
    _assert_same(restored_state, optimizer.state_dict())
    assert isinstance(restored_state["param_groups"][0]["betas"], tuple)

    twin, twin_optimizer = _model_and_optimizer(0)
    twin.load_state_dict(model.state_dict())
    twin_optimizer.load_state_dict(restored_state)
    _train(model, optimizer, 2, seed=2)
    _train(twin, twin_optimizer, 2, seed=2)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)


def test_lr_scheduler_state_round_trips(tmp_path):
    _, optimizer = _model_and_optimizer(0)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=20)
    for _ in range(4):
        optimizer.step()
        scheduler.step()
    restored = unflatten_state(*_through_disk(tmp_path, *flatten_state(scheduler.state_dict())))
    _assert_same(restored, scheduler.state_dict())


def test_flatten_refuses_what_only_pickle_could_store():
    with pytest.raises(TypeError, match="a/0"):
        flatten_state({"a": [object()]})
    with pytest.raises(TypeError, match="key"):
        flatten_state({("tuple", "key"): 1})


def test_rng_state_round_trip_repeats_draws_exactly(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    random.random(), np.random.rand(), torch.rand(1)  # move off the seeded state
    json_part, tensors = capture_rng_state()
    json_part = json.loads(json.dumps(json_part))
    save_file(tensors, tmp_path / "rng.safetensors")

    def draw():
        return [random.random() for _ in range(3)], np.random.rand(3).tolist(), torch.rand(3).tolist()

    first = draw()
    draw()
    restore_rng_state(json_part, load_file(tmp_path / "rng.safetensors"))
    assert draw() == first


# --------------------------------------------------------------------------------------------------
# save / load
# --------------------------------------------------------------------------------------------------


def test_save_load_round_trip(tmp_path):
    embed = torch.randn(10, 4)
    tensors = {
        "policy": {
            "embed.weight": embed,
            "lm_head.weight": embed,
            "norm": torch.ones(4, dtype=torch.bfloat16),
        },
        "value": {"head": torch.arange(6.0).reshape(2, 3).t()},  # not contiguous
        "empty": {},
    }
    state = {"step": 7, "policy_version": 7, "kl": {"value": 0.05}, "cursor": {"epoch": 1, "index": 12}}
    path = _save(tmp_path, 7, tensors=tensors, state=state)

    loaded = load_checkpoint(path)
    assert path.name == "step-000007" and loaded.step == 7 and loaded.path == path
    assert loaded.state == state
    assert set(loaded.tensors) == {"policy", "value", "empty"}
    for group, group_tensors in tensors.items():
        for name, tensor in group_tensors.items():
            assert (
                torch.equal(loaded.tensors[group][name], tensor)
                and loaded.tensors[group][name].dtype == tensor.dtype
            )
    manifest = loaded.manifest
    assert manifest["tag"] == "ok" and manifest["config"] == CONFIG and manifest["identities"] == IDENTITIES
    assert manifest["world_size"] == 1 and manifest["created"]
    assert {"torch", "transformers", "peft", "lmppo", "python"} <= set(manifest["versions"])
    assert set(manifest["files"]) == {
        "policy.safetensors",
        "value.safetensors",
        "empty.safetensors",
        "state.json",
    }
    for name, record in manifest["files"].items():
        assert record["bytes"] == (path / name).stat().st_size and len(record["sha256"]) == 64
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step-000007"
    assert latest_checkpoint(tmp_path) == path


def test_resaving_a_step_replaces_it(tmp_path):
    _save(tmp_path, 3, state={"attempt": 1})
    path = _save(tmp_path, 3, tag="interrupted", state={"attempt": 2})
    loaded = load_checkpoint(path)
    assert loaded.state == {"attempt": 2} and loaded.manifest["tag"] == "interrupted"
    assert [p.name for p in (tmp_path / "checkpoints").iterdir() if p.is_dir()] == ["step-000003"]


def test_a_sharded_save_adopts_other_ranks_files_and_each_rank_loads_its_own(tmp_path):
    """A sharded checkpoint: rank 1 wrote its groups first; rank 0's save moves them in and hashes them.
    Loaded by the same world size, a rank reads only its own shards; by another, every rank's."""
    checkpoints = tmp_path / "checkpoints"
    scratch = shard_scratch_dir(checkpoints, 4)
    scratch.mkdir(parents=True)
    write_tensor_groups(scratch, {"policy-rank1": {"w": torch.ones(2)}})
    path = save_checkpoint(
        checkpoints,
        4,
        tensors={"policy-rank0": {"w": torch.zeros(2)}, "rng": {"rank0/torch": torch.zeros(3)}},
        state={},
        manifest={**MANIFEST, "world_size": 2},
        keep_last=2,
        adopt=sorted(scratch.iterdir()),
    )
    assert "policy-rank1.safetensors" in json.loads((path / "manifest.json").read_text())["files"]
    assert not scratch.exists()  # emptied into the checkpoint, then pruned
    assert load_checkpoint(path, rank=1, world_size=2).tensors.keys() == {"policy-rank1", "rng"}
    assert load_checkpoint(path, rank=0, world_size=1).tensors.keys() == {
        "policy-rank0",
        "policy-rank1",
        "rng",
    }
    (path / "policy-rank1.safetensors").write_bytes(b"x")  # an adopted file is verified like any other
    with pytest.raises(LmppoError, match="policy-rank1.safetensors"):
        load_checkpoint(path, rank=0, world_size=2)


def test_missing_manifest_keys_and_bad_tags_are_refused(tmp_path):
    with pytest.raises(ValueError, match="world_size"):
        save_checkpoint(
            tmp_path, 1, tensors={}, state={}, manifest={"config": {}, "identities": {}}, keep_last=1
        )
    with pytest.raises(ValueError, match="tag"):
        _save(tmp_path, 1, tag="fine")


def _flip_middle_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("file", ["policy.safetensors", "state.json"])
def test_a_corrupted_byte_is_refused_naming_the_file_and_another_checkpoint(tmp_path, file):
    _save(tmp_path, 1)
    path = _save(tmp_path, 2)
    _flip_middle_byte(path / file)
    with pytest.raises(LmppoError, match=rf"step-000002 is damaged: {file}.*sha256.*lmppo ppo --resume"):
        load_checkpoint(path)


def test_a_truncated_file_is_refused(tmp_path):
    _save(tmp_path, 1)
    path = _save(tmp_path, 2)
    with open(path / "policy.safetensors", "r+b") as f:
        f.truncate(10)
    with pytest.raises(
        LmppoError, match=r"policy.safetensors has 10 bytes.*truncated.*newest intact checkpoint"
    ):
        load_checkpoint(path)
    assert latest_checkpoint(tmp_path).name == "step-000001"  # the pointer's target is incomplete


def test_a_missing_file_or_manifest_is_refused(tmp_path):
    path = _save(tmp_path, 1)
    (path / "state.json").unlink()
    with pytest.raises(LmppoError, match="state.json is missing.*--resume"):
        load_checkpoint(path)
    (path / "manifest.json").unlink()
    with pytest.raises(LmppoError, match="manifest.json is missing"):
        load_checkpoint(path)
    with pytest.raises(LmppoError, match="no checkpoint at"):
        load_checkpoint(tmp_path / "nowhere")


@pytest.mark.parametrize("damage", ["truncate", "flip", "no_manifest", "delete_weights"])
def test_a_resume_sets_a_damaged_newest_checkpoint_aside_and_says_so(tmp_path, damage):
    _save(tmp_path, 1)
    newest = _save(tmp_path, 2)
    if damage == "truncate":
        (newest / "policy.safetensors").write_bytes((newest / "policy.safetensors").read_bytes()[:10])
    elif damage == "flip":
        _flip_middle_byte(newest / "policy.safetensors")
    elif damage == "no_manifest":
        (newest / "manifest.json").unlink()
    else:
        (newest / "policy.safetensors").unlink()
    checkpoint, damaged = load_intact_checkpoint(tmp_path)
    assert (
        checkpoint.path.name == "step-000001" and len(damaged) == 1 and damaged[0].startswith("step-000002")
    )
    assert not newest.exists() and (newest.parent / "damaged-step-000002").is_dir()  # kept for inspection
    assert latest_checkpoint(tmp_path).name == "step-000001"


def test_a_resume_with_no_intact_checkpoint_finds_none_and_keeps_them_all(tmp_path):
    path = _save(tmp_path, 1)
    _flip_middle_byte(path / "policy.safetensors")
    checkpoint, damaged = load_intact_checkpoint(tmp_path)
    assert checkpoint is None and damaged and (path.parent / "damaged-step-000001").is_dir()


def test_pruning_keeps_the_last_k_plus_the_last_good_one(tmp_path):
    for step, tag in [(1, "ok"), (2, "ok"), (3, "aborted"), (4, "interrupted"), (5, "aborted")]:
        _save(tmp_path, step, tag=tag, keep_last=2)
    kept = sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.is_dir())
    assert kept == ["step-000002", "step-000004", "step-000005"]
    assert last_good_checkpoint(tmp_path).name == "step-000002"
    assert latest_checkpoint(tmp_path).name == "step-000005"
    _save(tmp_path, 6, keep_last=2)  # a newer ok one releases step 2
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.is_dir()) == [
        "step-000005",
        "step-000006",
    ]


def test_a_run_resumed_from_an_older_step_keeps_what_it_saves(tmp_path):
    for step in (1, 2, 3):
        _save(tmp_path, step, keep_last=1)
    path = _save(tmp_path, 2, keep_last=1)  # resumed from step 1: step 3 belongs to the abandoned attempt
    assert path.is_dir() and latest_checkpoint(tmp_path) == path


def test_latest_ignores_temp_dirs_and_survives_a_damaged_pointer(tmp_path):
    _save(tmp_path, 1)
    good = _save(tmp_path, 2)
    checkpoints = tmp_path / "checkpoints"
    (checkpoints / ".tmp-step-000003-dead").mkdir()  # a save killed before its rename
    (checkpoints / ".tmp-step-000003-dead" / "policy.safetensors").write_bytes(b"half")
    (checkpoints / "step-000004").mkdir()  # no manifest: never a complete checkpoint
    assert latest_checkpoint(tmp_path) == good
    for garbage in [b"\xff\xfe", b"step-000009\n", b"../../etc\n", b""]:
        (checkpoints / "latest").write_bytes(garbage)
        assert latest_checkpoint(tmp_path) == good
    assert (
        latest_checkpoint(tmp_path / "no-run") is None and last_good_checkpoint(tmp_path / "no-run") is None
    )
    _save(tmp_path, 5)  # the next save clears the leftovers of the dead one
    assert not list(checkpoints.glob(".tmp-*"))


_SAVE_FOREVER = textwrap.dedent(
    """
    import sys, torch
    from pathlib import Path
    from lmppo.runs.checkpoint import save_checkpoint
    manifest = {"config": {}, "identities": {}, "world_size": 1}
    for i in range(10**6):
        step = 1 + i // 2  # every step is saved twice: the re-save path is killed too
        tensors = {"policy": {"w": torch.full((512, 1024), float(step))}, "optimizer": {"m": torch.rand(256, 1024)}}
        tag = "ok" if step % 3 else "aborted"
        save_checkpoint(Path(sys.argv[1]), step, tensors=tensors, state={"step": step}, manifest=manifest,
                        tag=tag, keep_last=2)
    """
)


@pytest.mark.slow
def test_killing_a_save_at_random_moments_never_leaves_a_loadable_damaged_checkpoint(tmp_path):
    rng = random.Random(0)
    for trial in range(6):
        run_dir = tmp_path / f"run{trial}"
        process = subprocess.Popen([sys.executable, "-c", _SAVE_FOREVER, str(run_dir / "checkpoints")])
        try:
            deadline = time.monotonic() + 60
            while not (run_dir / "checkpoints" / "latest").exists():
                assert process.poll() is None and time.monotonic() < deadline, "the saver never saved"
                time.sleep(0.02)
            time.sleep(rng.uniform(0.0, 0.6))
        finally:
            os.kill(process.pid, signal.SIGKILL)
            process.wait()
        latest = latest_checkpoint(run_dir)
        loaded = load_checkpoint(latest)  # verifies every hash
        assert torch.all(loaded.tensors["policy"]["w"] == loaded.state["step"])
        good = last_good_checkpoint(run_dir)
        if good is not None:
            assert load_checkpoint(good).manifest["tag"] == "ok"


# --------------------------------------------------------------------------------------------------
# Resume compatibility
# --------------------------------------------------------------------------------------------------


def test_identical_runs_are_compatible():
    manifest = json.loads(json.dumps(MANIFEST))
    assert check_compatible(manifest, CONFIG, IDENTITIES, allow_mismatch=False, world_size=1) == []


def test_resumable_keys_may_change():
    assert "run.steps" in RESUMABLE_KEYS and "logging" in RESUMABLE_KEYS
    config = {**CONFIG, "run": {"steps": 500, "seed": 0}, "logging": {"quiet": True}}
    assert check_compatible(MANIFEST, config, IDENTITIES, allow_mismatch=False) == []


def test_differences_are_refused_listing_both_values_and_the_override():
    config = {**CONFIG, "ppo": {"lr": 3e-5, "clip_eps": 0.2}, "run": {"steps": 100, "seed": 1}}
    identities = {**IDENTITIES, "reward": {"path": "rm2", "sha256": "cc"}}
    with pytest.raises(LmppoError) as err:
        check_compatible(MANIFEST, config, identities, allow_mismatch=False, world_size=2)
    message = str(err.value)
    for line in [
        "config.ppo.lr: checkpoint 1e-05, now 3e-05",
        "config.run.seed: checkpoint 0, now 1",
        'identities.reward.path: checkpoint "rm", now "rm2"',
        "world_size: checkpoint 1, now 2",
        "--allow-config-change",
        "sampling and shuffling generators start afresh",  # what another number of ranks changes
    ]:
        assert line in message


def test_the_override_returns_the_differences():
    config = {**CONFIG, "ppo": {"lr": 1e-5}, "kl": {"beta": 0.1}}
    differences = check_compatible(MANIFEST, config, IDENTITIES, allow_mismatch=True)
    assert differences == [
        "config.kl.beta: checkpoint (absent), now 0.1",
        "config.ppo.clip_eps: checkpoint 0.2, now (absent)",
    ]


def test_a_key_added_by_a_newer_lmppo_at_its_default_is_no_difference():
    """A checkpoint written before ``ppo.lam_policy`` existed resumes under the version that added it:
    the default keeps the old behaviour. The same key at another value is a difference."""
    at_default = {**CONFIG, "ppo": {**CONFIG["ppo"], "lam_policy": None, "ratio_level": "token"}}
    assert check_compatible(MANIFEST, at_default, IDENTITIES, allow_mismatch=False) == []
    changed = {**CONFIG, "ppo": {**CONFIG["ppo"], "lam_policy": 0.9}}
    with pytest.raises(LmppoError, match="config.ppo.lam_policy: checkpoint \\(absent\\), now 0.9"):
        check_compatible(MANIFEST, changed, IDENTITIES, allow_mismatch=False)


@pytest.mark.parametrize(
    "error",
    [
        OSError(errno.ENOSPC, "No space left on device"),  # what Python's own writes raise
        SafetensorError(  # what safetensors raises for the tensors, word for word
            'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'
        ),
    ],
    ids=["os", "safetensors"],
)
def test_a_full_disk_during_a_save_keeps_the_previous_checkpoint_latest_and_says_so(
    tmp_path, monkeypatch, error
):
    import lmppo.runs.checkpoint

    previous = _save(tmp_path, 1)

    def full_disk(*args, **kwargs):
        raise error

    monkeypatch.setattr(lmppo.runs.checkpoint, "save_file", full_disk)
    with pytest.raises(
        LmppoError, match=r"No space left on device.*latest checkpoint is still .*step-000001"
    ):
        _save(tmp_path, 2)
    assert latest_checkpoint(tmp_path) == previous and load_checkpoint(previous).step == 1
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))  # the partial save is gone
