"""Checkpoints: all of a run's state, written atomically and verified on load. No pickle anywhere.

``RUN_DIR/checkpoints/step-000010/`` holds one ``<group>.safetensors`` per tensor group (``policy``,
``value``, ``optimizer``, ``rng``, ...), ``state.json`` (everything that is not a tensor) and
``manifest.json`` (step, tag, creation time, resolved config, model identities, package versions,
world size, and sha256 + size of every other file). ``RUN_DIR/checkpoints/latest`` names the newest
complete checkpoint. See docs/checkpoints.md.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import json
import os
import platform
import random
import re
import shutil
import socket
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from lmppo.errors import LmppoError
from lmppo.inputs.config import schema_default
from lmppo.version import __version__

CHECKPOINTS_DIR = "checkpoints"
LATEST_FILE = "latest"
LOCK_FILE = ".lmppo.lock"  # held by the one process that writes a run directory
BEST_FILE = "best"  # names the checkpoint with the best held-out score
STATE_FILE = "state.json"
MANIFEST_FILE = "manifest.json"
TENSOR_SUFFIX = ".safetensors"
TAGS = ("ok", "unhealthy", "aborted", "interrupted")  # "unhealthy": a guard rule broken (in warm-up)
FORMAT_VERSION = 1
REQUIRED_MANIFEST_KEYS = ("config", "identities", "world_size")
# Config keys a resumed run may change without --allow-config-change (dotted prefixes).
RESUMABLE_KEYS = (
    "run.steps",
    "run.output_dir",
    "run.checkpoint_every",
    "run.keep_last",
    "run.eval_every",
    "run.eval_batch_size",
    "run.threads",
    "distributed.timeout_s",
    "distributed.shard_frozen",  # where frozen weights live, not what they compute
    "distributed.checkpoint",  # how checkpoints are split into files: either kind loads
    "data.slice_key",  # read by the pre-flight only, which a resumed run does not repeat
    "logging",
    "guards",
    "diagnosis",  # what is watched and reported, not what is trained
)
# What a resume cannot change, even with --allow-config-change: the trained models' starting weights and
# their adapter and critic layout. The checkpoint's weights would replace or misfit them.
FIXED_KEYS = (
    "config.models.policy_lora",
    "config.models.value",
    "config.ppo.advantage",  # a critic would appear or vanish
    "config.run.algorithm",
    *(
        f"identities.{role}.{field}"
        for role in ("policy", "value")
        for field in ("weights_sha256", "num_parameters", "trainable_parameters", "lora", "shared_with")
    ),
)
_TMP_PREFIX = ".tmp-"  # in-progress saves and deletions: never matches a checkpoint name
_CHECKPOINT_NAME = re.compile(r"step-(\d+)")
_GROUP_NAME = re.compile(r"[A-Za-z0-9_-]+")


@dataclass
class Checkpoint:
    """A loaded, verified checkpoint. ``tensors`` maps group (file stem) to its tensors."""

    tensors: dict[str, dict[str, torch.Tensor]]
    state: dict
    manifest: dict
    path: Path

    @property
    def step(self) -> int:
        return self.manifest["step"]


def checkpoint_name(step: int) -> str:
    return f"step-{step:06d}"


# --------------------------------------------------------------------------------------------------
# Nested state (optimizer, scheduler) as tensors + a JSON skeleton
# --------------------------------------------------------------------------------------------------


def flatten_state(obj: Any) -> tuple[dict[str, torch.Tensor], Any]:
    """Split a nested state (dicts, lists, tuples, tensors, JSON scalars) into tensors and a skeleton.

    The skeleton is JSON-able: dicts become ``{"dict": [[key, value], ...]}`` (keeps int keys such as
    an optimizer's parameter ids), tuples ``{"tuple": [...]}``, tensors ``{"tensor": name}`` where
    ``name`` is the tensor's path, e.g. ``state/0/exp_avg``. :func:`unflatten_state` inverts it.
    """
    tensors: dict[str, torch.Tensor] = {}

    def walk(node: Any, path: tuple[str, ...]) -> Any:
        where = "/".join(path)
        if isinstance(node, torch.Tensor):
            if where in tensors:
                raise ValueError(f"two entries of the state flatten to the same name {where!r}")
            tensors[where] = node
            return {"tensor": where}
        if isinstance(node, dict):
            for key in node:
                if not (key is None or isinstance(key, (str, int, float))):
                    raise TypeError(f"state key {key!r} at {where or '(root)'} is not a JSON scalar")
            return {"dict": [[k, walk(v, (*path, str(k)))] for k, v in node.items()]}
        if isinstance(node, tuple):
            return {"tuple": [walk(v, (*path, str(i))) for i, v in enumerate(node)]}
        if isinstance(node, list):
            return [walk(v, (*path, str(i))) for i, v in enumerate(node)]
        if node is None or isinstance(node, (str, int, float)):
            return node
        raise TypeError(f"cannot store a {type(node).__name__} at {where or '(root)'} without pickle")

    return tensors, walk(obj, ())


def unflatten_state(tensors: dict[str, torch.Tensor], skeleton: Any) -> Any:
    """Rebuild what :func:`flatten_state` split."""
    if isinstance(skeleton, list):
        return [unflatten_state(tensors, s) for s in skeleton]
    if isinstance(skeleton, dict):
        ((kind, body),) = skeleton.items()
        if kind == "tensor":
            return tensors[body]
        if kind == "tuple":
            return tuple(unflatten_state(tensors, s) for s in body)
        return {key: unflatten_state(tensors, value) for key, value in body}
    return skeleton


# --------------------------------------------------------------------------------------------------
# RNG state
# --------------------------------------------------------------------------------------------------


def capture_rng_state() -> tuple[dict, dict[str, torch.Tensor]]:
    """``(json_part, tensors)`` of python ``random``, numpy's global RNG, torch CPU and every CUDA device."""
    version, internal, gauss_next = random.getstate()
    kind, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    json_part = {
        "python": [version, list(internal), gauss_next],
        "numpy": [kind, keys.tolist(), pos, has_gauss, cached_gaussian],
    }
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors |= {f"cuda_{i}": state for i, state in enumerate(torch.cuda.get_rng_state_all())}
    return json_part, tensors


def restore_rng_state(json_part: dict, tensors: dict[str, torch.Tensor]) -> None:
    """Inverse of :func:`capture_rng_state`. CUDA states are restored on the devices present."""
    version, internal, gauss_next = json_part["python"]
    random.setstate((version, tuple(internal), gauss_next))
    kind, keys, pos, has_gauss, cached_gaussian = json_part["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached_gaussian))
    torch.set_rng_state(tensors["torch"])
    if torch.cuda.is_available():
        for device in range(torch.cuda.device_count()):
            if f"cuda_{device}" in tensors:
                torch.cuda.set_rng_state(tensors[f"cuda_{device}"], device)


# --------------------------------------------------------------------------------------------------
# Saving
# --------------------------------------------------------------------------------------------------


def package_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {"python": platform.python_version(), "lmppo": __version__}
    for package in ("torch", "transformers", "peft"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return versions


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _synced_file_record(path: Path) -> dict[str, Any]:
    """fsync ``path`` and return its manifest entry."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    return {"sha256": digest, "bytes": path.stat().st_size}


def _storable(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU and contiguous, and no two entries sharing memory (safetensors refuses tied weights)."""
    out, seen = {}, set()
    for name, tensor in tensors.items():
        tensor = tensor.detach().cpu().contiguous()
        storage = tensor.untyped_storage().data_ptr()
        out[name] = tensor.clone() if storage in seen else tensor
        seen.add(storage)
    return out


def _remove(path: Path) -> None:
    """Delete a file or directory; a directory is first renamed out of sight so that a crash during
    the deletion never leaves a partial checkpoint under a checkpoint's name."""
    if path.is_dir():
        hidden = path.with_name(f"{_TMP_PREFIX}del-{path.name}-{uuid.uuid4().hex[:8]}")
        os.rename(path, hidden)
        shutil.rmtree(hidden)
    else:
        path.unlink(missing_ok=True)


def write_tensor_groups(directory: Path, tensors: dict[str, dict[str, torch.Tensor]]) -> None:
    """One ``<group>.safetensors`` per group in ``directory``."""
    for group, group_tensors in tensors.items():
        if not _GROUP_NAME.fullmatch(group):
            raise ValueError(f"tensor group name {group!r} must match {_GROUP_NAME.pattern}")
        save_file(_storable(group_tensors), directory / f"{group}{TENSOR_SUFFIX}")


def shard_scratch_dir(checkpoints_dir: str | Path, step: int) -> Path:
    """Where the ranks of a sharded save write their own groups before rank 0 commits the checkpoint
    (a temp name: never taken for a checkpoint, and cleared by the next save's pruning)."""
    return Path(checkpoints_dir) / f"{_TMP_PREFIX}shards-{checkpoint_name(step)}"


def _write_checkpoint_files(
    directory: Path, step: int, tensors: dict, state: dict, manifest: dict, tag: str, adopt: list[Path]
) -> None:
    write_tensor_groups(directory, tensors)
    for path in adopt:  # the other ranks' groups, already written: moved in before the manifest hashes them
        os.replace(path, directory / path.name)
    _write_synced(directory / STATE_FILE, json.dumps(state, indent=1))
    files = {path.name: _synced_file_record(path) for path in sorted(directory.iterdir())}
    full_manifest = {
        **manifest,
        "format_version": FORMAT_VERSION,
        "step": step,
        "tag": tag,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "versions": package_versions(),
        "files": files,
    }
    _write_synced(directory / MANIFEST_FILE, json.dumps(full_manifest, indent=1))  # written last
    _fsync_dir(directory)


def save_checkpoint(
    checkpoints_dir: str | Path,
    step: int,
    *,
    tensors: dict[str, dict[str, torch.Tensor]],
    state: dict,
    manifest: dict,
    tag: str = "ok",
    keep_last: int,
    adopt: list[Path] = (),
    best: bool = False,
) -> Path:
    """Write ``checkpoints_dir/step-NNNNNN`` atomically, point ``latest`` at it, prune old ones.

    ``manifest`` must hold ``config`` (resolved, JSON-able), ``identities`` (the four models) and
    ``world_size``; step, tag, time, versions and file hashes are added here. ``keep_last``: keep the
    newest K checkpoints plus the newest ``ok`` one (and the ``best`` one). Re-saving an existing step
    replaces it. ``adopt``: tensor files other processes wrote (a sharded save's ranks), moved into the
    checkpoint and hashed. ``best``: point ``best`` at this checkpoint too.
    """
    if tag not in TAGS:
        raise ValueError(f"checkpoint tag {tag!r} must be one of {TAGS}")
    missing = [key for key in REQUIRED_MANIFEST_KEYS if key not in manifest]
    if missing:
        raise ValueError(f"checkpoint manifest lacks {missing}")
    checkpoints_dir = Path(checkpoints_dir)
    checkpoints_dir.mkdir(parents=True, exist_ok=True)
    final = checkpoints_dir / checkpoint_name(step)
    staging = checkpoints_dir / f"{_TMP_PREFIX}{final.name}-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    try:
        _write_checkpoint_files(staging, step, tensors, state, manifest, tag, list(adopt))
    except (OSError, SafetensorError) as err:  # a full disk, a quota, a vanished mount (safetensors' own
        shutil.rmtree(staging, ignore_errors=True)  # error for the tensors): older checkpoints are untouched
        kept = latest_checkpoint(checkpoints_dir.parent)
        raise LmppoError(
            f"could not write checkpoint {final} ({getattr(err, 'strerror', None) or err}); nothing was "
            f"replaced: the latest "
            f"checkpoint is still {kept or 'none'}. Free space (or fix the directory) and continue with "
            f"`lmppo ppo --resume {checkpoints_dir.parent}`."
        ) from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if final.exists():
        _remove(final)
    os.rename(staging, final)
    _fsync_dir(checkpoints_dir)
    _point_at(checkpoints_dir, LATEST_FILE, final.name)  # last: the checkpoint is now committed
    if best:
        _point_at(checkpoints_dir, BEST_FILE, final.name)
    _prune(checkpoints_dir, keep_last, just_saved=final)
    return final


def _point_at(checkpoints_dir: Path, pointer: str, name: str) -> None:
    """Atomically make the file ``pointer`` (``latest``, ``best``) name checkpoint ``name``."""
    tmp = checkpoints_dir / f"{_TMP_PREFIX}{pointer}-{uuid.uuid4().hex[:8]}"
    _write_synced(tmp, name + "\n")
    os.replace(tmp, checkpoints_dir / pointer)
    _fsync_dir(checkpoints_dir)


def _prune(checkpoints_dir: Path, keep_last: int, just_saved: Path) -> None:
    """Keep the ``keep_last`` highest steps, the newest ``ok`` one and the one just saved (a run resumed
    from an older checkpoint saves below the abandoned attempt's steps); clear leftover temp files."""
    for leftover in checkpoints_dir.glob(f"{_TMP_PREFIX}*"):
        shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()
    checkpoints = _checkpoint_dirs(checkpoints_dir)
    best = best_checkpoint(checkpoints_dir.parent)
    keep = {*checkpoints[-keep_last:], _newest_complete(checkpoints_dir, tag="ok"), just_saved, best}
    for path in checkpoints:
        if path not in keep:
            _remove(path)


# --------------------------------------------------------------------------------------------------
# Finding and loading
# --------------------------------------------------------------------------------------------------


def _checkpoint_dirs(checkpoints_dir: Path) -> list[Path]:
    """Directories named like a checkpoint, oldest first (temp dirs never match)."""
    if not checkpoints_dir.is_dir():
        return []
    found = [p for p in checkpoints_dir.iterdir() if p.is_dir() and _CHECKPOINT_NAME.fullmatch(p.name)]
    return sorted(found, key=lambda p: int(_CHECKPOINT_NAME.fullmatch(p.name)[1]))


def _read_manifest(path: Path) -> dict | None:
    try:
        manifest = json.loads((path / MANIFEST_FILE).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and isinstance(manifest.get("files"), dict) else None


def _file_problem(path: Path, record: dict) -> str | None:
    """Why ``path`` does not match its manifest entry, or None when it does."""
    if not path.is_file():
        return "is missing"
    size = path.stat().st_size
    if size != record["bytes"]:
        return f"has {size} bytes where the manifest says {record['bytes']} (truncated or overwritten)"
    with open(path, "rb") as f:
        if hashlib.file_digest(f, "sha256").hexdigest() != record["sha256"]:
            return "does not match its sha256 in the manifest (corrupted)"
    return None


def _is_complete(path: Path) -> dict | None:
    """The manifest when every file it lists is present with its size (cheap: no hashing)."""
    manifest = _read_manifest(path)
    if manifest is None:
        return None
    for name, record in manifest["files"].items():
        file = path / name
        if not file.is_file() or file.stat().st_size != record.get("bytes"):
            return None
    return manifest


def _newest_complete(
    checkpoints_dir: Path, tag: str | None = None, exclude: Path | None = None
) -> Path | None:
    for path in reversed(_checkpoint_dirs(checkpoints_dir)):
        manifest = _is_complete(path) if path != exclude else None
        if manifest is not None and (tag is None or manifest.get("tag") == tag):
            return path
    return None


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The checkpoint ``latest`` points at; the newest complete one if the pointer is damaged."""
    checkpoints_dir = Path(run_dir) / CHECKPOINTS_DIR
    try:
        pointed = checkpoints_dir / (checkpoints_dir / LATEST_FILE).read_text().strip()
    except (OSError, UnicodeDecodeError):
        pointed = None
    if pointed is not None and _CHECKPOINT_NAME.fullmatch(pointed.name) and _is_complete(pointed):
        return pointed
    return _newest_complete(checkpoints_dir)


def best_checkpoint(run_dir: str | Path) -> Path | None:
    """The complete checkpoint ``best`` names (the best held-out score so far), or None."""
    checkpoints_dir = Path(run_dir) / CHECKPOINTS_DIR
    try:
        pointed = checkpoints_dir / (checkpoints_dir / BEST_FILE).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return pointed if _CHECKPOINT_NAME.fullmatch(pointed.name) and _is_complete(pointed) else None


def last_good_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint tagged ``ok`` (the last-known-good state of the run)."""
    return _newest_complete(Path(run_dir) / CHECKPOINTS_DIR, tag="ok")


class DamagedCheckpoint(LmppoError):
    """A checkpoint whose files do not match its manifest (or that has no readable manifest)."""

    def __init__(self, path: Path, problem: str) -> None:
        run_dir = path.parent.parent
        super().__init__(
            f"checkpoint {path} is damaged: {problem}. `lmppo ppo --resume {run_dir}` continues from the newest "
            "intact checkpoint and sets damaged ones aside (as damaged-step-*) for inspection."
        )
        self.path, self.problem = path, problem


_RANK_GROUP = re.compile(r".+-rank(\d+)")  # a sharded checkpoint's per-rank group: policy-rank3


def load_checkpoint(path: str | Path, rank: int | None = None, world_size: int | None = None) -> Checkpoint:
    """Load a checkpoint after verifying every file against the manifest's sha256 and size.

    A sharded checkpoint (per-rank groups ``<group>-rank<r>``) written by ``world_size`` ranks loads only
    ``rank``'s own groups; written by another number of ranks, every rank's (to be put together whole).
    """
    path = Path(path)
    if not path.is_dir():
        raise LmppoError(f"no checkpoint at {path}: expected a directory like {CHECKPOINTS_DIR}/step-000010")
    manifest = _read_manifest(path)
    if manifest is None:
        raise DamagedCheckpoint(path, f"{MANIFEST_FILE} is missing or unreadable")
    for name, record in manifest["files"].items():
        problem = _file_problem(path / name, record)
        if problem:
            raise DamagedCheckpoint(path, f"{name} {problem}")
    own_shards_only = rank is not None and manifest.get("world_size") == world_size

    def wanted(group: str) -> bool:
        shard = _RANK_GROUP.fullmatch(group)
        return shard is None or not own_shards_only or int(shard[1]) == rank

    groups = [name.removesuffix(TENSOR_SUFFIX) for name in manifest["files"] if name.endswith(TENSOR_SUFFIX)]
    tensors = {group: load_file(path / f"{group}{TENSOR_SUFFIX}") for group in groups if wanted(group)}
    state = json.loads((path / STATE_FILE).read_text())
    return Checkpoint(tensors=tensors, state=state, manifest=manifest, path=path)


def load_intact_checkpoint(
    run_dir: str | Path, set_aside: bool = True, rank: int | None = None, world_size: int | None = None
) -> tuple[Checkpoint | None, list[str]]:
    """The checkpoint a resume continues from: the one ``latest`` names, else the newest by step, each
    verified in full; a damaged one is skipped (renamed ``damaged-step-*`` when ``set_aside``, so neither
    pruning nor a re-saved step removes it). Returns the checkpoint (None when no intact one is left)
    and one line per damaged checkpoint skipped."""
    checkpoints_dir = Path(run_dir) / CHECKPOINTS_DIR
    try:
        pointed = checkpoints_dir / (checkpoints_dir / LATEST_FILE).read_text().strip()
    except (OSError, UnicodeDecodeError):
        pointed = None
    candidates = list(reversed(_checkpoint_dirs(checkpoints_dir)))
    if pointed is not None and pointed in candidates:  # a resumed attempt's higher steps were abandoned
        candidates = [pointed, *(p for p in candidates if _step_of(p) < _step_of(pointed))]
    skipped = []
    for path in candidates:
        try:
            return load_checkpoint(path, rank, world_size), skipped
        except DamagedCheckpoint as damage:
            skipped.append(f"{path.name}: {damage.problem}")
            if set_aside:
                _set_aside(path)
    return None, skipped


def _step_of(path: Path) -> int:
    return int(_CHECKPOINT_NAME.fullmatch(path.name)[1])


def _set_aside(path: Path) -> None:
    target = path.with_name(f"damaged-{path.name}")
    for n in range(1, 1000):
        if not target.exists():
            break
        target = path.with_name(f"damaged-{path.name}-{n}")
    try:
        os.replace(path, target)
    except OSError:  # another rank set it aside first
        pass


# --------------------------------------------------------------------------------------------------
# Resume compatibility
# --------------------------------------------------------------------------------------------------

_ABSENT = object()


def _dotted(obj: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; lists and empty dicts are leaves."""
    if isinstance(obj, dict) and obj:
        return {k: v for key, value in obj.items() for k, v in _dotted(value, f"{prefix}{key}.").items()}
    return {prefix.removesuffix("."): obj}


def _resumable(key: str) -> bool:
    inner = key.removeprefix("config.")
    return inner != key and any(inner == r or inner.startswith(r + ".") for r in RESUMABLE_KEYS)


def check_compatible(
    manifest: dict, config: dict, identities: dict, allow_mismatch: bool, world_size: int | None = None
) -> list[str]:
    """Differences between a checkpoint and the run resuming it, as ``key: checkpoint X, now Y`` lines.

    Compares the resolved config (except :data:`RESUMABLE_KEYS`), the model identities and, when
    given, the world size. Differences are an error unless ``allow_mismatch``
    (``--allow-config-change``); then they are returned for the trainer to record.
    """
    saved = {"config": manifest["config"], "identities": manifest["identities"]}
    now = json.loads(json.dumps({"config": config, "identities": identities}))  # tuples -> lists, as saved
    if world_size is not None:
        saved["world_size"], now["world_size"] = manifest["world_size"], world_size
    saved, now = _dotted(saved), _dotted(now)
    differences = [
        f"{key}: checkpoint {_show(saved.get(key, _ABSENT))}, now {_show(now.get(key, _ABSENT))}"
        for key in sorted(saved.keys() | now.keys())
        if not _resumable(key)
        and saved.get(key, _ABSENT) != now.get(key, _ABSENT)
        and not _added_at_default(key, saved, now)
    ]
    fixed = [d for d in differences if d.startswith(FIXED_KEYS)]
    if fixed:
        lines = "\n".join(f"  - {d}" for d in fixed)
        raise LmppoError(
            f"cannot resume: the checkpoint's trained weights belong to other models than this run's:\n{lines}\n"
            "A resume cannot change the policy, reference or critic (or their LoRA layout); start a new run "
            "(another run.output_dir) to train these models."
        )
    if differences and not allow_mismatch:
        lines = "\n".join(f"  - {d}" for d in differences)
        ranks = (
            " With another number of ranks the weights, optimizer, schedule, KL controller and data position "
            "carry over, but each rank's sampling and shuffling generators start afresh: the run does not "
            "continue bit for bit."
            if any(d.startswith("world_size") for d in differences)
            else ""
        )
        raise LmppoError(
            f"cannot resume: this run differs from the checkpoint it resumes:\n{lines}\n"
            f"Pass --allow-config-change to resume anyway (the differences are recorded in the run).{ranks}"
        )
    return differences


def _added_at_default(key: str, saved: dict, now: dict) -> bool:
    """A key a newer lmppo added, at its default: the checkpoint's run behaved as that default does
    (every new key's default keeps the old behaviour), so it is no difference."""
    inner = key.removeprefix("config.")
    return inner != key and key not in saved and now.get(key, _ABSENT) == schema_default(inner)


def _show(value: Any) -> str:
    return "(absent)" if value is _ABSENT else json.dumps(value)


# --------------------------------------------------------------------------------------------------
# One writer per run directory
# --------------------------------------------------------------------------------------------------


class RunDirLock:
    """The run directory's owner: an exclusive ``flock`` on ``RUN_DIR/.lmppo.lock`` for the life of the
    run. The kernel drops it when the process ends however it ends (exit, crash, SIGKILL), so a dead
    run's directory is free at once; a live one refuses a second writer, naming its process and host.
    """

    def __init__(self, run_dir: Path) -> None:
        run_dir = Path(run_dir)
        if run_dir.exists() and not run_dir.is_dir():
            raise LmppoError(
                f"run.output_dir={run_dir} is an existing file; set run.output_dir to a directory"
            )
        self.created = not run_dir.exists()
        self.run_dir, self.path = run_dir, run_dir / LOCK_FILE
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            self.fd = self._acquire()
        except OSError as err:  # read-only, no permission, a file where a directory must be, a full disk
            raise LmppoError(
                f"cannot write in run.output_dir={run_dir} ({err.strerror or err}); set run.output_dir to a "
                "directory this process can write"
            ) from None

    def _acquire(self) -> int:
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 4096).decode(errors="replace").strip() or "another process"
                os.close(fd)
                self._undo_mkdir()
                raise LmppoError(
                    f"run.output_dir={self.run_dir} is in use: {holder} is writing it (it holds {self.path} "
                    "while it runs). Wait for that run to end or stop it; as soon as its process is gone, "
                    "also after a crash or a SIGKILL, `lmppo ppo --resume` takes the directory over. To run "
                    "something else alongside, set run.output_dir to another directory"
                ) from None
            try:  # the file may have been unlinked by a holder that released it between open and flock
                if os.fstat(fd).st_ino == os.stat(self.path).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        started = datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        os.ftruncate(fd, 0)
        os.write(fd, f"process {os.getpid()} on {socket.gethostname()} (since {started})\n".encode())
        return fd

    def release(self) -> None:
        """Give the directory up (unlinked first, so no one locks the file being let go)."""
        self.path.unlink(missing_ok=True)
        os.close(self.fd)
        self._undo_mkdir()

    def _undo_mkdir(self) -> None:
        """A run directory this lock created and nothing was written to is removed again."""
        if self.created and self.run_dir.is_dir() and not any(self.run_dir.iterdir()):
            self.run_dir.rmdir()
