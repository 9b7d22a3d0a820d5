"""Loading models from local files: a transformers directory (safetensors), a GGUF file, or a hub id that
is already in the local Hugging Face cache. Nothing is ever downloaded, nothing is unpickled. The dtype
a model loads in is its config section's (decided by :mod:`lmppo.inputs.resolve`, never here).

The policy and the reference are causal LMs; a reward model is a sequence scorer
(``AutoModelForSequenceClassification``, one label). Frozen models are in ``eval()`` with no gradients.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import shutil
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.utils import logging as transformers_logging

from lmppo.errors import LmppoError, read_from
from lmppo.inputs.config import ModelSource
from lmppo.modeling.quantize import quantize

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json")


def quiet_transformers() -> None:
    """Switch off transformers' progress bars ("Loading weights", "Writing model shards", a GGUF file's
    de-quantizing) and its load reports: they would interleave with lmppo's own lines, and lmppo checks what
    matters in them itself (a reward model without a trained score head is refused). Warnings still show;
    ``TRANSFORMERS_VERBOSITY`` wins when set. The CLI (unless ``--verbose``) and the Python API call this
    before they load models."""
    from transformers import modeling_gguf_pytorch_utils

    transformers_logging.disable_progress_bar()
    # The GGUF loader draws its bar with tqdm itself, past the switch above: give it transformers' own.
    modeling_gguf_pytorch_utils.tqdm = transformers_logging.tqdm
    if "TRANSFORMERS_VERBOSITY" not in os.environ:
        transformers_logging.set_verbosity_error()


# --------------------------------------------------------------------------------------------------
# Locating model files (never downloading)
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ResolvedSource:
    """Where a model's files are on disk: a local directory, plus the GGUF file name inside it if any."""

    directory: Path
    gguf_file: str | None = None

    def __str__(self) -> str:
        return str(self.directory / self.gguf_file) if self.gguf_file else str(self.directory)


def as_model_source(model: ModelSource | str | os.PathLike) -> ModelSource:
    """A config model section as given, or a bare path as one with every default (fp32, no GGUF)."""
    return model if isinstance(model, ModelSource) else ModelSource(path=str(model))


def resolve_source(model: ModelSource | str | os.PathLike) -> ResolvedSource:
    """Find a model section's (or a bare path's) files: a directory, a ``.gguf`` file, or a hub id already
    in the local HF cache. Raises :class:`LmppoError` when nothing is on disk: lmppo never downloads.
    """
    spec = as_model_source(model)
    local, gguf_file = Path(spec.path).expanduser(), spec.gguf_file
    if local.is_file() and local.suffix == ".gguf" and gguf_file is None:
        return ResolvedSource(local.parent, local.name)
    if local.is_file():
        raise LmppoError(
            f"model path {spec.path!r} is a file, not a model: point it at a transformers model directory "
            "(config.json and safetensors weights) or a .gguf file"
        )
    if local.is_dir():
        if gguf_file is not None and not (local / gguf_file).is_file():
            raise LmppoError(
                f"GGUF file {gguf_file!r} not found in {local}; check `gguf_file` in the config."
            )
        return ResolvedSource(local, gguf_file)
    cached = _local_hub_snapshot(spec.path)
    if cached is None:
        raise LmppoError(
            f"model path {spec.path!r} does not exist{read_from(spec.path)} and is not in the local Hugging "
            "Face cache. "
            "lmppo never downloads models: fetch it first (e.g. `hf download ORG/NAME --local-dir DIR`) "
            "and point the config at that directory."
        )
    return resolve_source(ModelSource(path=str(cached), gguf_file=gguf_file))


def _local_hub_snapshot(repo_id: str) -> Path | None:
    """The cached snapshot directory of ``repo_id`` if the HF cache already holds it, else None."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError, OSError):
        return None


def _refuse_non_model_directory(
    source: ResolvedSource, *, enough: tuple[str, ...] = ("config.json",)
) -> None:
    """Refuse a directory holding none of ``enough`` before transformers is asked: it would blame a missing
    ``model_type`` key of a config.json that does not exist. A .gguf file inside is named, as it is often
    what the user meant."""
    if source.gguf_file or any((source.directory / name).is_file() for name in enough):
        return
    found = sorted(p.name for p in source.directory.glob("*.gguf"))
    if len(found) == 1:
        hint = f" It holds {found[0]}: set `models.<role>.path` to {source.directory / found[0]}."
    elif found:
        hint = f" It holds {', '.join(found)}: set `models.<role>.path` to one of them."
    else:
        hint = ""
    raise LmppoError(
        f"model path {str(source.directory)!r} is a directory with no config.json: not a transformers model "
        "directory, so transformers cannot load it. Point it at a directory saved with save_pretrained (config.json + safetensors) or at a "
        f".gguf file.{hint}"
    )


def _from_pretrained_kwargs(spec: ModelSource, source: ResolvedSource, *, weights: bool = True) -> dict:
    """``from_pretrained`` keywords: local files only, the GGUF file, and (for weights) the dtype."""
    kwargs = {"local_files_only": True, "trust_remote_code": spec.trust_remote_code}
    if weights:
        kwargs["dtype"] = DTYPES[spec.dtype or "float32"]  # the config section has validated the name
    if source.gguf_file:
        kwargs["gguf_file"] = source.gguf_file
    return kwargs


def _load_error(what: str, source: ResolvedSource, err: Exception) -> LmppoError:
    if "ignore_mismatched_sizes" in str(err) or "size mismatch for" in str(err):
        mismatches = _shape_mismatches(source)
        first = mismatches[0] if mismatches else "see transformers' report above"
        return LmppoError(
            f"{source}: its config.json disagrees with its weights ({len(mismatches)} tensors differ; the "
            f"first: {first}). The weights were saved from another configuration: restore the config.json "
            "saved with them, or save the model again with `save_pretrained`"
        )
    if "trust_remote_code" in str(err):
        return LmppoError(
            f"{what} at {source} needs custom code from its repository; set `trust_remote_code: true` "
            f"in the model config only if you trust that code. (transformers: {err})"
        )
    return LmppoError(f"cannot load {what} from {source}: {err}")


# --------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------


def _shape_mismatches(source: ResolvedSource) -> list[str]:
    """Each weight whose shape in the files differs from the one ``config.json`` builds (on the meta device)."""
    from safetensors import safe_open

    if source.gguf_file:  # a GGUF file carries its own configuration
        return []
    config = AutoConfig.from_pretrained(source.directory, local_files_only=True)
    with torch.device("meta"):
        expected = {
            k: tuple(v.shape) for k, v in AutoModelForCausalLM.from_config(config).state_dict().items()
        }
    found = []
    for path in weight_files(source):
        with safe_open(path, "pt") as weights:
            for name in weights.keys():  # noqa: SIM118 (safe_open is no mapping)
                shape = tuple(weights.get_slice(name).get_shape())
                if name in expected and expected[name] != shape:
                    found.append(
                        f"{name}: {list(shape)} in the weights, {list(expected[name])} by config.json"
                    )
    return found


def load_tokenizer(model: ModelSource | str | os.PathLike) -> PreTrainedTokenizerBase:
    """The tokenizer (with its chat template) of a model section (or a bare path): directory or GGUF."""
    spec = as_model_source(model)
    source = resolve_source(spec)
    _refuse_non_model_directory(source, enough=("config.json", *TOKENIZER_FILES))  # a tokenizer alone loads
    try:
        return _pretrained(AutoTokenizer, source, _from_pretrained_kwargs(spec, source, weights=False))
    except (OSError, ValueError, KeyError) as err:
        if source.gguf_file:
            raise LmppoError(
                f"GGUF file {source} has no usable tokenizer ({err}); use a GGUF file that embeds its "
                "tokenizer, or convert the model to a transformers directory that has one."
            ) from err
        raise _load_error("the tokenizer", source, err) from err


def load_model_config(model: ModelSource | str | os.PathLike):
    """A model's architecture config alone (no weights read): what :mod:`lmppo.runs.plan` sizes."""
    spec, source = as_model_source(model), resolve_source(model)
    _refuse_non_model_directory(source)
    try:
        return _pretrained(AutoConfig, source, _from_pretrained_kwargs(spec, source, weights=False))
    except (OSError, ValueError) as err:
        raise _load_error("the model config", source, err) from None


_parsed_gguf: dict[tuple, object] = {}  # (auto class, file, size, mtime, remote code) -> config or tokenizer


def _pretrained(auto, source: ResolvedSource, kwargs: dict):
    """``auto.from_pretrained`` (a config or a tokenizer) of a model's files. A GGUF file is parsed once
    per process (seconds each time, and ``lmppo init``'s plans, the plan and the run ask again); each
    caller gets a copy of its own."""
    if not source.gguf_file:
        return auto.from_pretrained(source.directory, **kwargs)
    file = source.directory / source.gguf_file
    stat = file.stat()
    key = (auto.__name__, str(file), stat.st_size, stat.st_mtime_ns, kwargs["trust_remote_code"])
    if key not in _parsed_gguf:
        _parsed_gguf[key] = auto.from_pretrained(source.directory, **kwargs)
    return copy.deepcopy(_parsed_gguf[key])


def _weights_source(model: ModelSource | str | os.PathLike) -> tuple[ModelSource, ResolvedSource]:
    """The section and its files, refusing a directory that is no model or whose weights only pickle could
    load."""
    spec = as_model_source(model)
    source = resolve_source(spec)
    _refuse_non_model_directory(source)
    if not source.gguf_file:
        names = {p.name for p in source.directory.iterdir() if p.suffix in WEIGHT_SUFFIXES}
        if names and not any(name.endswith(".safetensors") for name in names):
            raise LmppoError(
                f"{source} holds only pickled weights ({', '.join(sorted(names))}): lmppo loads safetensors only, "
                "since unpickling runs code from the file. Convert it once, where you trust the file: "
                "`AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(NEW_DIR)` (safetensors by default)."
            )
    return spec, source


def load_causal_lm(model: ModelSource | str | os.PathLike) -> PreTrainedModel:
    """A causal LM (policy or reference) from a model section (or a bare path), in its ``dtype``, its linear
    layers quantized when the section says so (:mod:`lmppo.modeling.quantize`)."""
    spec, source = _weights_source(model)
    try:
        lm = AutoModelForCausalLM.from_pretrained(source.directory, **_from_pretrained_kwargs(spec, source))
    except (OSError, ValueError, RuntimeError, SafetensorError) as err:
        raise _load_error("a causal LM", source, err) from err
    lm = _plain_if_gguf(lm, source)
    return quantize(lm, spec.quantize) if spec.quantize else lm


def _plain_if_gguf(model: PreTrainedModel, source: ResolvedSource) -> PreTrainedModel:
    """A GGUF file's tensors are dequantised as they load, yet transformers marks the model quantized and
    ``save_pretrained`` then refuses it (a run's ``final/``, a trained RM): drop the stale marks."""
    if source.gguf_file:
        model.hf_quantizer, model.is_quantized = None, False
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
    return model


def load_reward_model(model: ModelSource | str | os.PathLike, *, new_head: bool = False, pad_token_id=None):
    """A one-label sequence scorer from a model section (or a bare path), in its ``dtype``.

    By default it is a frozen reward model, and a checkpoint without a trained score head (e.g. a plain
    causal LM) is refused: transformers would silently give it a randomly initialised head. With
    ``new_head=True`` (reward-model training) a causal LM gets a fresh head and everything stays trainable;
    ``pad_token_id`` goes into its config.
    """
    spec, source = _weights_source(model)
    _check_reward_config(source, new_head)
    extra = {} if pad_token_id is None else {"pad_token_id": pad_token_id}
    try:
        scorer, info = AutoModelForSequenceClassification.from_pretrained(
            source.directory,
            num_labels=1,
            output_loading_info=True,
            **extra,
            **_from_pretrained_kwargs(spec, source),
        )
    except (OSError, ValueError, RuntimeError, SafetensorError) as err:
        raise _load_error("a reward model", source, err) from err
    scorer = _plain_if_gguf(scorer, source)
    if new_head:
        return scorer
    untrained_head = [key for key in info["missing_keys"] if key.split(".")[0] == "score"]
    if untrained_head:
        raise LmppoError(
            f"{source} has no trained score head ({', '.join(untrained_head)} missing): it is not a reward "
            "model. Train one with `lmppo train-rm`, or point `reward.model.path` at a reward-model checkpoint."
        )
    return freeze(quantize(scorer, spec.quantize) if spec.quantize else scorer)


def check_reward_model(model: ModelSource | str | os.PathLike) -> None:
    """What a reward model's config says, before any weight is read (``lmppo init``): a scorer with one
    output, not a causal LM nor a classifier with several outputs."""
    _check_reward_config(_weights_source(model)[1], new_head=False)


def _check_reward_config(source: ResolvedSource, new_head: bool) -> None:
    """A sequence classifier with several outputs is not a reward model (transformers would resize its
    head), and, unless it gets a ``new_head`` to train, neither is a causal LM (it would get a random one).
    A GGUF file's config says neither: its missing score head is found when it loads."""
    if source.gguf_file:
        return
    config = json.loads((source.directory / "config.json").read_text())  # there: _weights_source checked
    architectures = config.get("architectures") or []
    classifier = any(a.endswith("ForSequenceClassification") for a in architectures)
    labels = len(config["id2label"]) if "id2label" in config else 2  # transformers omits its default, 2
    if classifier and labels != 1:
        raise LmppoError(
            f"{source} is a sequence classifier with {labels} outputs; a reward model needs one scalar "
            "(num_labels=1). Train one with `lmppo train-rm`, or use a reward model with a single output."
        )
    if not classifier and not new_head and any(a.endswith("ForCausalLM") for a in architectures):
        raise LmppoError(
            f"{source} is a causal language model ({', '.join(architectures)}), not a reward model: a reward "
            "model scores a whole response with a trained one-output head (a ...ForSequenceClassification "
            "checkpoint). Train one from it on preference pairs with `lmppo train-rm`, or score with a "
            "function instead (reward.function, `lmppo init --reward-function file.py:score`)."
        )


def cache_gguf_as_transformers(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Convert a GGUF model once into a plain transformers directory (fp32 safetensors + tokenizer).

    Loading a GGUF file dequantises every tensor and converts the tokenizer (tens of seconds); the
    directory loads in about a second. The directory records the GGUF file's sha256 and is rebuilt when the file changes. Returns ``out_dir``.
    """
    source = resolve_source(gguf_path)
    if source.gguf_file is None:
        raise LmppoError(f"{gguf_path} is not a .gguf file.")
    out_dir = Path(out_dir)
    gguf_sha256 = file_sha256(source.directory / source.gguf_file)
    marker = out_dir / "lmppo_gguf_source.json"
    if marker.is_file() and json.loads(marker.read_text()).get("gguf_sha256") == gguf_sha256:
        return out_dir
    spec = ModelSource(path=str(source.directory), gguf_file=source.gguf_file)
    tokenizer, model = load_tokenizer(spec), load_causal_lm(spec)
    staging = out_dir.with_name(f"{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    (staging / marker.name).write_text(json.dumps({"gguf_file": str(source), "gguf_sha256": gguf_sha256}))
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(staging, out_dir)  # readers see either no directory or a complete one
    return out_dir


def freeze(model: nn.Module) -> nn.Module:
    """Make ``model`` frozen: ``eval()`` (no dropout) and no parameter gradients. Returns it."""
    model.requires_grad_(False)
    return model.eval()


def weight_files(source: ResolvedSource) -> list[Path]:
    """A model's weight files: its GGUF file, or the directory's weight files sorted by name."""
    if source.gguf_file:
        return [source.directory / source.gguf_file]
    return sorted(p for p in source.directory.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file())


def file_sha256(path: Path) -> str:
    """sha256 of a file's content, read in 4 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


@contextlib.contextmanager
def renames_unannounced() -> Iterator[None]:
    """transformers 5 announces the renaming of its gradient-checkpointing methods (to "activation
    checkpointing") on every call, also from inside peft: a FutureWarning that asks nothing of a user of
    lmppo. Silenced for the block; every other warning passes."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r"`(is_)?gradient_checkpointing\w*` is deprecated", FutureWarning)
        yield
