"""What this machine is, and whether it has what lmppo needs: the GPU check's first and second lines.

    python benchmarks/gpu_env.py            # Python, torch, CUDA, the GPU; each of lmppo's needs: have/need
    python benchmarks/gpu_env.py --require  # the same, and exit 1 naming every need that is missing or too old

Reads the needs from pyproject.toml, so it checks the floors the package declares (``datasets`` is imported
only to read dataset directories: missing, it is reported and tolerated).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import platform
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
OPTIONAL_HERE = {"datasets"}  # lazily imported: only `data.prompts` given as a dataset directory needs it


def needs() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]["dev"]
    test_tools = [r for r in map(Requirement, extras) if r.name in {"pytest", "hypothesis"}]
    return [*map(Requirement, project["dependencies"]), *test_tools]


def check(requirement: Requirement) -> tuple[str, bool]:
    try:
        version = importlib.metadata.version(requirement.name)
    except importlib.metadata.PackageNotFoundError:
        return "missing", False
    return version, requirement.specifier.contains(version, prereleases=True)


def describe_torch() -> str:
    import torch

    line = f"torch {torch.__version__}, CUDA {torch.version.cuda or 'none'}"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        line += f", {props.name} ({props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs)"
    return line + f", {torch.get_num_threads()} CPU threads"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--require", action="store_true", help="exit 1 if a need is missing or too old")
    args = parser.parse_args()
    print(f"Python {platform.python_version()} at {sys.executable}, {platform.machine()}")
    print(describe_torch())
    unmet = []
    for requirement in needs():
        version, ok = check(requirement)
        tolerated = not ok and requirement.name in OPTIONAL_HERE
        mark = (
            "ok"
            if ok
            else ("not needed here" if tolerated else "MISSING" if version == "missing" else "TOO OLD")
        )
        print(
            f"  {requirement.name:<14} {version:<14} needs {str(requirement.specifier) or 'any':<10} {mark}"
        )
        if not ok and not tolerated:
            unmet.append(f"{requirement} (have: {version})")
    try:
        import lmppo

        print(f"lmppo from {Path(lmppo.__file__).parent}")
    except ImportError:
        print("lmppo is not importable yet")
        unmet.append("lmppo")
    if args.require and unmet:
        sys.exit(
            f"this environment lacks {', '.join(unmet)}: add them to benchmarks/gpu_wheels.py's "
            "GPU_MACHINE_LACKS and run `make gpu-wheels` again"
        )


if __name__ == "__main__":
    main()
