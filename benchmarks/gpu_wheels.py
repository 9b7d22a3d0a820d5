"""What the offline GPU machine lacks, ready to travel with the working tree (``make gpu-wheels``).

That machine (docs/performance.md, "The GPU check") has Python 3.12, torch 2.11 and transformers 5.17 and
most of lmppo's needs, no network, and takes at most 64 MiB of files along. This writes:

- ``.gpu-wheels/``: wheels of the packages lmppo imports that the machine does not have, with their own
  needs, for CPython 3.12 on x86-64 Linux, plus the same versions for this machine's Python (so
  ``make gpu-dryrun`` installs exactly this set here), and ``requirements.txt`` naming what to install;
- ``.gpu-models/smollm2-135m/``: SmolLM2's tokenizer, chat template and config (no weights: the machine
  initialises them at random, benchmarks/random_models.py).

Then it prints their sizes and what the whole upload comes to.
"""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ROOT / ".gpu-wheels"
MODELS = ROOT / ".gpu-models"
UPLOAD_LIMIT = 64 * 2**20
# lmppo's imports the GPU machine lacks. `datasets` is imported only to read a dataset directory and `gguf`
# only by transformers for a GGUF file: neither is needed there, so neither travels.
GPU_MACHINE_LACKS = ["pydantic", "torchao"]  # torchao: quantized frozen models, optimizer offload
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]


def pip_download(*args: str) -> None:
    command = [sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "-d", str(WHEELS), *args]
    subprocess.run(command, check=True)


def download_wheels() -> list[str]:
    """The pinned requirements (the versions this environment tests with), for the GPU machine's Python and
    for this one."""
    pins = [f"{name}=={importlib.metadata.version(name)}" for name in GPU_MACHINE_LACKS]
    shutil.rmtree(WHEELS, ignore_errors=True)
    target = ["--python-version", "3.12", "--implementation", "cp", "--abi", "cp312"]
    pip_download(*target, *[arg for p in PLATFORMS for arg in ("--platform", p)], *pins)
    # Compiled wheels (pydantic-core) once more for this interpreter, same versions: the dry run's install.
    for wheel in list(WHEELS.glob("*.whl")):
        name, version = wheel.name.split("-")[:2]
        if not wheel.name.endswith("-none-any.whl"):
            pip_download("--no-deps", f"{name}=={version}")
    (WHEELS / "requirements.txt").write_text("".join(pin + "\n" for pin in pins))
    return pins


def size_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


def tracked_mb() -> float:
    names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return (
        sum((ROOT / n).stat().st_size for n in names.decode().split("\0") if n and (ROOT / n).is_file())
        / 2**20
    )


def main() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from random_models import pack

    pins = download_wheels()
    shutil.rmtree(MODELS, ignore_errors=True)
    pack(MODELS / "smollm2-135m")
    for wheel in sorted(WHEELS.glob("*.whl")):
        print(f"  {wheel.name}  {wheel.stat().st_size / 2**20:.1f} MiB")
    wheels, models, tracked = size_mb(WHEELS), size_mb(MODELS), tracked_mb()
    total = wheels + models + tracked
    print(f"{WHEELS.name}/ {wheels:.1f} MiB ({', '.join(pins)}), {MODELS.name}/ {models:.1f} MiB")
    print(
        f"upload: tracked files {tracked:.1f} MiB + these = {total:.1f} MiB of {UPLOAD_LIMIT / 2**20:.0f} MiB"
    )
    if total * 2**20 > UPLOAD_LIMIT:
        sys.exit("too large to travel to the GPU machine: leave something out")


if __name__ == "__main__":
    main()
