"""The benchmark keeps working: smallest size, 2 steps, lmppo alone (CI has no TRL). No timing assertions."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_ppo.py"
FIGURES = {
    "seconds_per_step",
    "tokens_per_second",
    "generation_tokens_per_second",
    "phase_seconds",
    "peak_rss_mb",
    "train_gflops",
    "matmul_peak_gflops",
    "train_peak_fraction",
    "flop_floor_s",
}
PHASES = {
    "generation",
    "logprobs",
    "values",
    "scoring",
    "update_forward",
    "backward",
    "optimizer",
    "gc",
    "other",
}


def run_bench(script: Path, *args: str) -> dict:
    """Run a benchmark script; it must exit 0 and print its report as the last line, in JSON."""
    done = subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_bench_runs_and_prints_the_json_line(tmp_path):
    report = run_bench(
        BENCH,
        "--sizes",
        "h128_l4",
        "--steps",
        "2",
        "--warmup",
        "0",
        "--repeats",
        "1",
        "--impls",
        "lmppo",
        "--variants",
        "",
        "--no-quickstart",
        "--profile",
        "--work-dir",
        str(tmp_path),
    )
    assert {"date", "machine", "cpu_flags", "settings", "results"} <= set(report)
    lmppo = report["results"]["h128_l4"]["lmppo"]
    assert FIGURES <= set(lmppo)
    assert set(lmppo["phase_seconds"]) == PHASES
    assert lmppo["seconds_per_step"] > 0 and lmppo["peak_rss_mb"] > 0
    assert "trl" not in report["results"]["h128_l4"]  # not asked for: lmppo is reported alone
    profile = lmppo["profile"]  # one more step under the profiler, split by phase and by kind of op
    assert {"generation", "update_forward", "backward"} <= set(profile["phases"])
    assert profile["matmul"] > 0 and profile["phases"]["backward"]["matmul"] > 0
    split = sum(profile[k] for k in ("matmul", "attention", "other_ops", "outside_ops"))
    assert split == pytest.approx(profile["wall_s"], abs=0.01)


BENCH_DISTRIBUTED = BENCH.parent / "bench_distributed.py"


@pytest.mark.slow
@pytest.mark.distributed
def test_bench_distributed_runs_one_process_ddp_and_fsdp2(run_files, tmp_path):
    report = run_bench(
        BENCH_DISTRIBUTED,
        "--config",
        str(run_files),
        "--setups",
        "1,ddp:2,fsdp2:2",
        "--steps",
        "2",
        "--warmup",
        "0",
        "--repeats",
        "1",
        "--work-dir",
        str(tmp_path / "bench"),
    )
    one, ddp, fsdp2 = (report["results"][setup] for setup in ("1", "ddp:2", "fsdp2:2"))
    assert one["allreduce_mb_per_step"] == 0 and one["seconds_per_step"] > 0
    # DDP sent every trainable parameter's gradient once per optimiser step (float32)
    assert ddp["allreduce_mb_per_step"] == pytest.approx(ddp["expected_allreduce_mb_per_step"], rel=0.01)
    # FSDP2 holds half the trained state on each of 2 ranks; it gathers weights and scatters gradients
    assert fsdp2["trained_state_mb_per_rank"] == pytest.approx(ddp["trained_state_mb_per_rank"] / 2, rel=0.02)
    assert fsdp2["reduce_scatter_mb_per_step"] > 0 and fsdp2["allgather_mb_per_step"] > 0
    assert fsdp2["allreduce_mb_per_step"] == 0


@pytest.mark.slow
def test_bench_memory_runs_every_mode(tmp_path):
    report = run_bench(
        BENCH.parent / "bench_memory.py", "--rows", "1", "--response", "8", "--out", str(tmp_path)
    )
    assert list(report["results"]) == [
        "one micro-batch",
        "gradient_checkpointing",
        "gradient_checkpointing + micro_batch_tokens=1024",
    ]
    assert all(r["peak_rss_mb"] > 0 and r["update_s"] > 0 for r in report["results"].values())
    assert all(r["plan_peak_mb"] > 0 for r in report["results"].values())


@pytest.mark.slow
def test_bench_gpu_runs_on_cpu_too(tmp_path):
    """The GPU benchmark's code path, at its smallest size on CPU (CI has no GPU): random SmolLM2 weights
    in a fresh process, stopped once its steps are logged, the plan within 15 % of the measured peak RSS,
    and the table and JSON lines written for a cut-off run to keep."""
    args = [
        "--device",
        "cpu",
        "--rows-only",
        "smollm2-135m fp32",
        "--steps",
        "1",
        "--rows",
        "2",
        "--tokens",
        "4",
    ]
    report = run_bench(
        BENCH.parent / "bench_gpu.py", *args, "--out", str(tmp_path), "--work", str(tmp_path / "work")
    )
    result = report["results"]["smollm2-135m fp32"]
    assert "error" not in result, result
    assert result["step_s"] > 0 and result["peak_mb"] > 0 and abs(result["plan_error"]) < 0.15
    assert result["params_m"] == 135 and result["gen_tflops"] > 0
    assert "| smollm2-135m fp32 (135M) |" in (tmp_path / "gpu_bench.md").read_text()
    assert json.loads((tmp_path / "gpu_bench.jsonl").read_text())["row"] == "smollm2-135m fp32"
    assert not (
        tmp_path / "work" / "runs" / "smollm2-135m-fp32" / "final"
    ).exists()  # stopped before the end's save


def test_random_models_have_the_sizes_their_names_say():
    """SmolLM2-135M's own config; Llama-3.2-1B and -3B shapes on SmolLM2's vocabulary (meta device: no memory)."""
    import torch
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(BENCH.parent))
    from random_models import SHAPES, model_config, smollm2_files

    sizes, files = {}, smollm2_files()  # outside the meta device: a fresh machine converts the GGUF first
    for shape in SHAPES:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(model_config(shape, files))
        sizes[shape] = round(sum(p.numel() for p in model.parameters()) / 1e6)
    assert sizes == {"smollm2-135m": 135, "llama-1b": 1074, "llama-3b": 2970}


def test_bench_gpu_dry_run_plans_every_row_for_a_139_gib_gpu(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            str(BENCH.parent / "bench_gpu.py"),
            "--dry-run",
            "--out",
            str(tmp_path),
            "--work",
            str(tmp_path / "models"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    plans = [line for line in done.stdout.splitlines() if "plan" in line]
    sys.path.insert(0, str(BENCH.parent))
    from bench_gpu import ROWS

    assert len(plans) == len(ROWS) and all(line.endswith(", fits") for line in plans), done.stdout
    assert "llama-1b bf16 24 GB config: plan 20.4 GiB" in done.stdout  # examples/llama_1b/ppo_24gb.yaml


def test_ablation_resumes_from_its_results_and_reports_aborted_seeds(tmp_path, monkeypatch, capsys):
    """benchmarks/ablate_quickstart.py with its quickstarts faked: each row reuses its seed's 'default'
    run, rows already in results.jsonl are not run again (--table-only runs none), and a run a guard
    stopped is named."""
    sys.path.insert(0, str(BENCH.parent))
    import ablate_quickstart

    calls = []

    def fake_run(out, seed, overrides, models_from):
        calls.append((out.name, seed, models_from and models_from.name))
        (out / "ppo").mkdir(parents=True)
        (out / "ppo" / "quickstart.json").write_text("{}")
        if overrides == ["ppo.ptx_coef=0.1"] and seed == 1:
            return {"failed": 3, "stderr": "guard"}
        gold = 2.0 + 0.1 * seed + 0.05 * bool(overrides)
        figures = {"gold_ppo": gold, "gap_closed": (gold - 1.5) / 1.2, "win_rate": 0.75, "kl": 2.0}
        return {**figures, "ppl_ratio": 1.5, "gold_repeat": 1.9}

    monkeypatch.setattr(ablate_quickstart, "run", fake_run)
    args = ["--seeds", "0,1", "--rows", "default,ptx 0.1", "--work-dir", str(tmp_path)]
    ablate_quickstart.main(args)
    assert calls == [("base", 0, None), ("ptx_0.1", 0, "base"), ("base", 1, None), ("ptx_0.1", 1, "base")]
    calls.clear()
    ablate_quickstart.main(args)  # everything is in results.jsonl already
    assert calls == []
    ablate_quickstart.main([*args[2:], "--seeds", "0,1,2", "--table-only"])  # seed 2 is missing: not run
    assert calls == [] and "| default | `—` | 2.050 ± 0.071 |" in capsys.readouterr().out
    rows = ablate_quickstart.table(
        [json.loads(line) for line in (tmp_path / "results.jsonl").open()], ["default", "ptx 0.1"]
    ).splitlines()
    assert rows[2].startswith("| default | `—` | 2.050 ± 0.071 | 0.46 ± 0.06 | 0.42 |")
    assert rows[3].startswith(
        "| ptx 0.1 (seeds [1] stopped by a guard) | `ppo.ptx_coef=0.1` | 2.050 ± 0.000 |"
    )


def test_smollm2_ablation_judges_each_answer_and_reads_the_runs_own_evaluations(tmp_path, monkeypatch):
    """benchmarks/ablate_smollm2.py on a faked finished run: correct and brief come from judge.py on the
    evaluated answers, the best held-out score from metrics.jsonl, the RM's accuracy from its directory."""
    sys.path.insert(0, str(BENCH.parent))
    import ablate_smollm2

    from lmppo.inputs.config import load_config

    rm_dir, out = tmp_path / "rm", tmp_path / "run"
    rm_dir.mkdir()
    (rm_dir / "rm_eval.json").write_text(json.dumps({"accuracy": 0.8}))
    out.mkdir()
    config = load_config(ablate_smollm2.EXAMPLE / ablate_smollm2.RM, [f"reward.model.path={rm_dir}"])
    (out / "config.yaml").write_text(config.to_yaml())
    prompt = "What is the capital of Germany?"
    answers = [
        "Berlin.",
        "The capital of Germany is Vienna, I believe, and Berlin is second in size and in its fame.",
    ]
    rows = [{"prompt": prompt, "response": a} for a in answers]
    start = {"eval/gold_score": 0.1}
    ppo = {"eval/gold_score": 0.5, "eval/response/length": 9.0, "eval/response/eos_frac": 1.0}
    ppo |= {"eval/kl/ref": 3.0, "eval/win_rate": 0.7}
    record = {"summary": {"policies": {"start": start, "PPO": ppo}}, "policies": {"PPO": {"rows": rows}}}
    (out / "eval.json").write_text(json.dumps(record))
    evals = [{"step": 0, "eval/gold_score": 0.1}, {"step": 10, "eval/gold_score": 0.6}, {"step": 20}]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals))
    result = ablate_smollm2.figures(out)
    # the second answer names Vienna, another capital, before Berlin, and runs past 12 words
    assert result["correct"] == 0.5 and result["brief"] == 0.5
    assert (result["best_meets"], result["best_step"]) == (0.6, 10) and result["rm_accuracy"] == 0.8

    monkeypatch.setattr(
        ablate_smollm2, "run", lambda out, seed, config, overrides, command: {**result, "wall_s": 60.0}
    )
    ablate_smollm2.main(["--seeds", "0,1", "--rows", "rm balanced", "--work-dir", str(tmp_path / "ab")])
    lines = ablate_smollm2.table(
        [json.loads(line) for line in (tmp_path / "ab" / "results.jsonl").open()], ["rm balanced"]
    ).splitlines()
    assert lines[2].startswith(
        "| rm balanced | `reward.model.path=runs/smollm2/rm_balanced` | 0.500 ± 0.000 | 0.500 |"
    )
    assert lines[2].endswith("| 0.800 | 1.0 |")


def test_ablation_rows_get_what_they_name_in_the_seeds_base_run(tmp_path):
    """A 'clean ptx' row: prepare() writes into the seed's base quickstart the demonstrations the gold judge
    rates correct and ended, and fills in their path; a row that names nothing there is left as is."""
    sys.path.insert(0, str(BENCH.parent))
    import ablate_quickstart

    base = tmp_path / "base"
    (base / "world" / "data").mkdir(parents=True)
    prompt = [{"role": "user", "content": "count to 3"}]
    responses = ["1 2 3.", "1 2 3", "1 2.", "sure! 1 2 3."]  # gold 2.0, 1.5 (no period), 1.33 (wrong), 2.4
    demos = "".join(json.dumps({"prompt": prompt, "response": r}) + "\n" for r in responses)
    (base / "world" / "data" / "sft_train.jsonl").write_text(demos)

    overrides = ablate_quickstart.prepare(base, 0, ablate_quickstart.ROWS["clean ptx 0.1"])
    clean = base / "sft_train_clean.jsonl"
    assert overrides == ["ppo.ptx_coef=0.1", f"data.ptx_demonstrations={clean}"]
    assert [json.loads(line)["response"] for line in clean.open()] == ["1 2 3.", "sure! 1 2 3."]
    assert ablate_quickstart.prepare(base, 0, ["kl.beta=0.6"]) == ["kl.beta=0.6"]


def test_trace_config_counts_where_the_config_is_read_before_step_1(run_files):
    """benchmarks/trace_config.py (the figures in docs/architecture.md) on a finished run's config."""
    from helpers import run_cli

    assert run_cli("ppo", str(run_files)) == 0
    out = subprocess.run(
        [sys.executable, str(BENCH.parent / "trace_config.py"), str(run_files.parent / "run")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()[1:]}
    # resolve is entered twice: resolve() decides the run, check_batches() the batch against the prompts
    assert rows["inputs.resolve"][0] == "2" and int(rows["total"][1]) > int(rows["total"][0]) > 0


@pytest.mark.slow
def test_bench_reward_server_loads_one_server_and_checks_every_answer(tmp_path):
    from helpers import REWARD_SPECIALS, REWARD_TEMPLATE, WORDS, build_tokenizer, llama_config
    from transformers import LlamaForSequenceClassification

    tokenizer = build_tokenizer(
        REWARD_SPECIALS, WORDS, pad="[EOS]", eos="[EOS]", chat_template=REWARD_TEMPLATE
    )
    LlamaForSequenceClassification(llama_config(tokenizer, num_labels=1)).save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    args = ["--rm", str(tmp_path / "rm"), "--seconds", "1", "--clients", "2", "--idle", "3", "--rows", "4"]
    report = run_bench(BENCH.parent / "bench_reward_server.py", *args, "--flood", "80", "--trickle", "2")
    flooded = "beside 80 sockets of a peer, 2 trickled heads"
    assert list(report["phases"]) == ["alone", "beside 3 idle connections", flooded]
    assert all(p["errors"] == 0 and p["requests_per_s"] > 0 for p in report["phases"].values())
    assert all(p["exact_answers"] == 1.0 for p in report["phases"].values())  # whole requests, alone-grouped
    assert report["server_peak_rss_mb"] > 0


@pytest.mark.slow
def test_bench_environments_times_the_tool_serial_and_concurrent(tmp_path):
    out = tmp_path / "runs.jsonl"
    args = ["--latency", "0.05", "--episodes", "4", "--turns", "2", "--steps", "1", "--out", str(out)]
    report = run_bench(BENCH.parent / "bench_environments.py", *args)
    assert json.loads(out.read_text()) == report and report["date"] and "cpu_flags" in report
    rows = report["results"]
    assert {"in-process sleep, serial", "in-process sleep, concurrent"} <= set(rows)
    # 4 episodes x 2 steps of 0.05 s: 0.4 s one after another; together, 2 waits of 0.05 s
    assert rows["in-process sleep, serial"]["environment_s"] >= 0.4
    assert rows["in-process sleep, concurrent"]["environment_s"] < 0.4
