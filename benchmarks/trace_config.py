"""How often the config enters each lmppo module before the first PPO step: a ``sys.setprofile`` trace of
``lmppo.runs.run.train`` on a finished run's config (a quickstart's is ``runs/quickstart/ppo``), counting
calls from one module into another that carry the config or one of its sections (any ``lmppo.inputs.config``
record) as an argument ("entries"), and every call that carries one, also within a module ("calls").

    python benchmarks/trace_config.py runs/quickstart/ppo
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections import Counter
from pathlib import Path

from pydantic import BaseModel

from lmppo.inputs import config as config_module
from lmppo.inputs.config import load_config
from lmppo.runs.run import train
from lmppo.training.trainer import PPOTrainer


class FirstStep(Exception):
    """Raised at the first PPO step: the trace ends there."""


def carries_config(frame) -> bool:
    code = frame.f_code
    names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
    values = [frame.f_locals.get(name) for name in names]
    return any(
        isinstance(v, BaseModel) and type(v).__module__.startswith(f"{config_module.__name__}.")
        for v in values
    )


def trace(cfg) -> tuple[Counter, Counter]:
    entries: Counter = Counter()
    calls: Counter = Counter()

    def profile(frame, event, arg):
        if event != "call":
            return
        module = frame.f_globals.get("__name__", "")
        caller = frame.f_back.f_globals.get("__name__", "") if frame.f_back else ""
        if module.startswith("lmppo.") and carries_config(frame):
            calls[module.removeprefix("lmppo.")] += 1
            entries[module.removeprefix("lmppo.")] += module != caller

    def stop(self):
        raise FirstStep

    step, PPOTrainer.step = PPOTrainer.step, stop
    sys.setprofile(profile)
    try:
        train(cfg)
    except FirstStep:
        pass
    finally:
        sys.setprofile(None)
        PPOTrainer.step = step
    return entries, calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="a run directory (its config.yaml is traced)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as out:
        overrides = [f"run.output_dir={out}/run", "logging.quiet=true"]
        cfg = load_config(args.run_dir / "config.yaml", overrides=overrides)
        entries, calls = trace(cfg)
    print(f"{'module':16s} {'entries':>8s} {'calls':>8s}")
    for module in sorted(calls, key=lambda m: (-entries[m], -calls[m])):
        print(f"{module:16s} {entries[module]:8d} {calls[module]:8d}")
    print(f"{'total':16s} {sum(entries.values()):8d} {sum(calls.values()):8d}")


if __name__ == "__main__":
    main()
