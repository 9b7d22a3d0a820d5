"""A corpus of malformed inputs, each fed to the command line as a user would.

Every case must end with exit code 2, one message naming the thing that is wrong (file and line, config
key, path) and no traceback, and must leave every file on disk as it was. (Faults in the middle of a run,
a reward function raising or a signal, write checkpoints by design: they are tested in test_run.py.)
"""

import copy
import hashlib
import json
from pathlib import Path

import pytest
import yaml
from helpers import COUNT_GOOD, PROMPTS, run_cli, toy_models

# --------------------------------------------------------------------------------------------------
# A world of valid files, built once; each case breaks one thing in a directory of its own
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("world")
    models = toy_models()
    models.policy.save_pretrained(root / "policy")
    models.tokenizer.save_pretrained(root / "policy")
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS * 2))
    (root / "demos.jsonl").write_text(json.dumps({"prompt": "tell me a story", "response": "the cat"}) + "\n")
    (root / "pairs.jsonl").write_text(
        json.dumps({"prompt": "hi", "chosen": "good", "rejected": "bad"}) + "\n"
    )
    config = base_config(root)
    config["run"] = {**config["run"], "output_dir": str(root / "finished")}
    (root / "finished.yaml").write_text(yaml.safe_dump(config))
    assert run_cli("ppo", str(root / "finished.yaml")) == 0  # a finished run, for --resume and eval
    return root


def base_config(root: Path) -> dict:
    return {
        "models": {"policy": {"path": str(root / "policy")}, "value": {"init_from": "policy"}},
        "reward": {"function": COUNT_GOOD},
        "data": {"prompts": str(root / "prompts.jsonl")},
        "rollout": {"batch_size": 4, "max_new_tokens": 6},
        "ppo": {"minibatch_size": 2, "ppo_epochs": 1, "lr": 1e-3},
        "run": {"output_dir": "set per case", "steps": 1, "seed": 1},
        "logging": {"quiet": True},
    }


def merged(base: dict, changes: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in changes.items():
        out[key] = merged(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


class Case:
    """One malformed input: ``setup(world, here)`` writes what it needs into ``here`` and returns the
    command line; ``expected`` must appear in the error message."""

    def __init__(self, name, expected, setup):
        self.name, self.expected, self.setup = name, expected, setup


def ppo(changes=None, *extra, drop=None):
    """``lmppo ppo CONFIG EXTRA...`` with the base config changed (``None`` values delete keys)."""

    def setup(world, here):
        config = merged(base_config(world), {"run": {"output_dir": str(here / "run")}})
        config = merged(config, changes(world, here) if callable(changes) else changes or {})
        for section, key in drop or []:
            config[section].pop(key) if key else config.pop(section)
        (here / "config.yaml").write_text(yaml.safe_dump(config))
        return ["ppo", str(here / "config.yaml"), *extra]

    return setup


def with_file(name, content, changes):
    """Write ``here/name`` (text or bytes), then run ``lmppo ppo`` with ``changes(path)``."""

    def changes_for(world, here):
        path = here / name
        path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
        return changes(path)

    return ppo(changes_for)


def prompts_file(content, name="prompts.jsonl"):
    return with_file(name, content, lambda path: {"data": {"prompts": str(path)}})


def reward_file(content, attribute="score"):
    return with_file("rewards.py", content, lambda path: {"reward": {"function": f"{path}:{attribute}"}})


def model_dir(build):
    """A model directory built by ``build(world, directory)``, as the policy."""

    def changes_for(world, here):
        directory = here / "model"
        directory.mkdir()
        build(world, directory)
        return {"models": {"policy": {"path": str(directory)}}}

    return ppo(changes_for)


def copy_policy(world, directory, skip=()):
    for file in (world / "policy").iterdir():
        if file.name not in skip:
            (directory / file.name).write_bytes(file.read_bytes())


def truncated_weights(world, directory):
    copy_policy(world, directory)
    weights = directory / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:500])


def pickled_weights(world, directory):
    copy_policy(world, directory, skip=("model.safetensors",))
    (directory / "pytorch_model.bin").write_bytes(b"\x80\x04 a pickle")


def reward_model_dir(labels):
    def changes_for(world, here):
        from helpers import REWARD_SPECIALS, REWARD_TEMPLATE, WORDS, build_tokenizer, llama_config
        from transformers import LlamaForCausalLM, LlamaForSequenceClassification

        tokenizer = build_tokenizer(
            REWARD_SPECIALS, WORDS, pad="[PAD]", eos="[EOS]", chat_template=REWARD_TEMPLATE
        )
        if labels is None:  # a plain causal LM: no score head
            model = LlamaForCausalLM(llama_config(tokenizer))
        else:
            model = LlamaForSequenceClassification(llama_config(tokenizer, num_labels=1))
            model.config.num_labels = labels
        model.save_pretrained(here / "rm")
        tokenizer.save_pretrained(here / "rm")
        return {
            "reward": {"model": {"path": str(here / "rm")}, "function": None},
            "models": {"value": {"init_from": "reward"}},
        }

    return ppo(changes_for)


def dataset_dir(damage):
    def changes_for(world, here):
        import datasets

        datasets.Dataset.from_list([{"prompt": p} for p in PROMPTS * 2]).save_to_disk(str(here / "ds"))
        damage(here / "ds")
        return {"data": {"prompts": str(here / "ds")}}

    return ppo(changes_for)


def supervised(command, changes=None, data=None):
    """``lmppo sft`` / ``lmppo train-rm`` with a config whose data file holds ``data`` lines."""

    def setup(world, here):
        config = {
            "model": {"path": str(world / "policy")},
            "data": str(here / "data.jsonl"),
            "output_dir": str(here / "out"),
            "epochs": 1,
        }
        if data is not None:
            (here / "data.jsonl").write_text(data)
        config = merged(config, changes(world, here) if callable(changes) else changes or {})
        config = {k: v for k, v in config.items() if v is not None}
        (here / "stage.yaml").write_text(yaml.safe_dump(config))
        return [command, str(here / "stage.yaml")]

    return setup


def resume(*extra):
    return lambda world, here: ["ppo", "--resume", str(world / "finished"), *extra]


PAIR = json.dumps({"prompt": "hi", "chosen": "good", "rejected": "bad"})
LONG = "the cat " * 100

CASES = [
    # -- config ------------------------------------------------------------------------------------
    Case("unknown key", "did you mean 'ppo.lr'", ppo(None, "ppo.lrr=1")),
    Case("unknown section", "did you mean 'rollout'", ppo(None, "rolout.batch_size=4")),
    Case("negative lr", "ppo.lr: Input should be greater than 0", ppo(None, "ppo.lr=-1")),
    Case("zero clip", "ppo.clip_eps", ppo(None, "ppo.clip_eps=0")),
    Case("gamma above one", "ppo.gamma", ppo(None, "ppo.gamma=2")),
    Case(
        "minibatch above batch", "larger than the 4 responses of a step", ppo(None, "ppo.minibatch_size=64")
    ),
    Case("micro-batch not dividing", "must divide ppo.minibatch_size", ppo(None, "ppo.micro_batch_size=3")),
    Case("two reward sources", "set exactly one of reward.model", ppo(None, "reward.model.path=x")),
    Case("no reward source", "set exactly one of reward.model", ppo(None, "reward.function=null")),
    Case("unknown KL estimator", "kl.estimator", ppo(None, "kl.estimator=k9")),
    Case("override without =", "not of the form section.key=value", ppo(None, "ppo")),
    Case("override into a value", "is a value, not a section", ppo(None, "models.policy.path.x=1")),
    Case(
        "penalty without a score",
        "gives truncated rows no score",
        ppo({"rollout": {"truncation": "bootstrap"}, "reward": {"missing_eos_penalty": 1.0}}),
    ),
    Case("zero temperature", "rollout.temperature", ppo(None, "rollout.temperature=0")),
    Case("top_p above one", "rollout.top_p", ppo(None, "rollout.top_p=1.5")),
    Case("unknown device", "run.device", ppo(None, "run.device=tpu")),
    Case("unknown sink", "logging.sinks", ppo(None, "logging.sinks=[nope]")),
    Case("unknown dtype", "models.policy.dtype", ppo(None, "models.policy.dtype=float8")),
    Case(
        "two forward batchings",
        "rollout.forward_batch_size (rows) or rollout.forward_batch_tokens",
        ppo(None, "rollout.forward_batch_size=2", "rollout.forward_batch_tokens=64"),
    ),
    Case(
        "lora sync without lora",
        "rollout.vllm_weight_sync=lora pushes the policy's LoRA adapters",
        ppo(None, "rollout.engine=vllm", "rollout.vllm_weight_sync=lora"),
    ),
    Case("fp16 precision", "run.precision=fp16 is not supported", ppo(None, "run.precision=fp16")),
    Case(
        "16-bit weights fully trained",
        "models.policy.dtype=bfloat16 would train every weight in 16 bits",
        ppo(None, "models.policy.dtype=bfloat16"),
    ),
    Case("missing data section", "data is required", ppo(drop=[("data", None)])),
    Case("missing config file", "does not exist", lambda world, here: ["ppo", str(here / "nope.yaml")]),
    Case("config is a directory", "is a directory", lambda world, here: ["ppo", str(here)]),
    Case(
        "config not YAML",
        "not valid YAML",
        lambda world, here: (
            here.joinpath("c.yaml").write_text("models: [unclosed"),
            ["ppo", str(here / "c.yaml")],
        )[1],
    ),
    Case(
        "config a list",
        "must hold a mapping",
        lambda world, here: (here.joinpath("c.yaml").write_text("- 1\n- 2\n"), ["ppo", str(here / "c.yaml")])[
            1
        ],
    ),
    Case("no config at all", "give a config file", lambda world, here: ["ppo"]),
    # -- prompts and demonstrations ------------------------------------------------------------------
    Case(
        "prompts missing",
        "does not exist",
        ppo(lambda world, here: {"data": {"prompts": str(here / "none.jsonl")}}),
    ),
    Case(
        "prompts a plain directory",
        "is a directory but not a dataset",
        ppo(lambda world, here: {"data": {"prompts": str(here)}}),
    ),
    Case(
        "prompt line not JSON",
        "prompts.jsonl, line 2: not valid JSON",
        prompts_file('{"prompt": "a"}\n{oops}\n'),
    ),
    Case("prompt line a list", "line 1: each line must be a JSON object", prompts_file("[1, 2]\n")),
    Case("row without prompt", "line 1 has no prompt", prompts_file('{"text": "hi"}\n')),
    Case("empty prompt", "line 1 has no prompt", prompts_file('{"prompt": ""}\n')),
    Case("messages not a list", "line 1 has no prompt", prompts_file('{"messages": "hi"}\n')),
    Case(
        "message without content",
        "line 1: messages turn 1",
        prompts_file('{"messages": [{"role": "user"}]}\n'),
    ),
    Case(
        "unknown role",
        "role 'narrator'",
        prompts_file('{"messages": [{"role": "narrator", "content": "x"}]}\n'),
    ),
    Case(
        "ends with the assistant",
        "end with an assistant turn",
        prompts_file(
            json.dumps(
                {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
            )
            + "\n"
        ),
    ),
    Case("not UTF-8", "line 2: not UTF-8", prompts_file(b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n')),
    Case("no prompts", "holds no prompts", prompts_file("\n")),
    Case(
        "prompt column missing",
        "line 2 has no column 'question' (data.prompt_key)",
        with_file(
            "prompts.jsonl",
            '{"question": "a"}\n{"prompt": "b"}\n',
            lambda path: {"data": {"prompts": str(path), "prompt_key": "question"}},
        ),
    ),
    Case(
        "CSV not UTF-8",
        "prompts.csv as CSV",
        with_file("prompts.csv", b"prompt\ncaf\xe9\n", lambda path: {"data": {"prompts": str(path)}}),
    ),
    Case(
        "Parquet that is not",
        "prompts.parquet as Parquet",
        with_file("prompts.parquet", "not parquet", lambda path: {"data": {"prompts": str(path)}}),
    ),
    Case(
        "dataset without state.json",
        "not a dataset",
        dataset_dir(lambda ds: [f.unlink() for f in ds.glob("*.json")]),
    ),
    Case(
        "dataset with a garbage arrow file",
        "cannot read the dataset directory",
        dataset_dir(lambda ds: [f.write_bytes(b"garbage") for f in ds.glob("*.arrow")]),
    ),
    Case(
        "fewer prompts than a batch",
        "larger than the 8 prompts",
        ppo(None, "rollout.batch_size=16", "ppo.minibatch_size=2"),
    ),
    Case(
        "over-long prompt",
        "prompts.jsonl, line 5 is",
        prompts_file("".join(json.dumps({"prompt": p}) + "\n" for p in [*PROMPTS, LONG])),
    ),
    Case(
        "ptx demonstrations missing",
        "does not exist",
        ppo(
            lambda world, here: {
                "data": {"ptx_demonstrations": str(here / "none.jsonl")},
                "ppo": {"ptx_coef": 0.1},
            }
        ),
    ),
    Case(
        "ptx demonstration without response",
        "demos.jsonl, line 1 has no 'response'",
        with_file(
            "demos.jsonl",
            '{"prompt": "a"}\n',
            lambda path: {"data": {"ptx_demonstrations": str(path)}, "ppo": {"ptx_coef": 0.1}},
        ),
    ),
    # -- models --------------------------------------------------------------------------------------
    Case(
        "policy path missing",
        "never downloads",
        ppo(lambda world, here: {"models": {"policy": {"path": str(here / "none")}}}),
    ),
    Case(
        "policy path a JSONL file",
        "is a file, not a model",
        ppo(lambda world, here: {"models": {"policy": {"path": str(world / "prompts.jsonl")}}}),
    ),
    Case("policy directory empty", "cannot load", model_dir(lambda world, directory: None)),
    Case("policy weights truncated", "cannot load a causal LM", model_dir(truncated_weights)),
    Case("policy weights pickled", "lmppo loads safetensors only", model_dir(pickled_weights)),
    Case(
        "GGUF file not in the directory",
        "GGUF file 'x.gguf' not found",
        ppo(
            lambda world, here: {"models": {"policy": {"path": str(world / "policy"), "gguf_file": "x.gguf"}}}
        ),
    ),
    Case("reward model that is a causal LM", "is a causal language model", reward_model_dir(None)),
    Case("reward model with two outputs", "2 outputs; a reward model needs one scalar", reward_model_dir(2)),
    Case(
        "critic from a reward model that is a function",
        "init_from=policy",
        ppo({"models": {"value": {"init_from": "reward"}}}),
    ),
    # -- reward functions ----------------------------------------------------------------------------
    Case(
        "reward spec without a colon",
        "must look like 'package.module:function'",
        ppo(None, "reward.function=nocolon"),
    ),
    Case(
        "reward module not importable",
        "cannot import module 'no_such_module'",
        ppo(None, "reward.function=no_such_module:f"),
    ),
    Case("reward attribute missing", "has no attribute 'nothing'", reward_file("x = 1\n", "nothing")),
    Case("reward attribute not callable", "'x' is a int, not a function", reward_file("x = 1\n", "x")),
    Case(
        "reward file missing",
        "no file",
        ppo(lambda world, here: {"reward": {"function": f"{here / 'none.py'}:f"}}),
    ),
    Case("reward file syntax error", "rewards.py, line 1", reward_file("def score(:\n")),
    Case(
        "reward file raising at import",
        "raised RuntimeError: no GPU here",
        reward_file("raise RuntimeError('no GPU here')\n"),
    ),
    # -- the file system and resuming ----------------------------------------------------------------
    Case(
        "output_dir a file",
        "is an existing file",
        ppo(
            lambda world, here: (
                here.joinpath("taken").write_text("notes"),
                {"run": {"output_dir": str(here / "taken")}},
            )[1]
        ),
    ),
    Case(
        "output_dir holds a run",
        "already holds a run",
        ppo(lambda world, here: {"run": {"output_dir": str(world / "finished")}}),
    ),
    Case(
        "resume a directory without a run",
        "holds no checkpoint yet",
        lambda world, here: ["ppo", "--resume", str(here)],
    ),
    Case(
        "resume a missing directory",
        "holds no checkpoint yet",
        lambda world, here: ["ppo", "--resume", str(here / "nowhere")],
    ),
    Case("resume with a changed config", "--allow-config-change", resume("run.steps=2", "ppo.lr=0.5")),
    Case(
        "resume with another LoRA layout",
        "cannot change the policy",
        resume("run.steps=2", "models.policy_lora.enabled=true", "--allow-config-change"),
    ),
    # -- the supervised stages, evaluation and the report --------------------------------------------
    Case("sft data missing", "data.jsonl does not exist", supervised("sft")),
    Case("sft data empty", "data.jsonl holds no demonstrations", supervised("sft", data="\n")),
    Case(
        "sft config without output_dir",
        "output_dir is required",
        supervised("sft", {"output_dir": None}, data="\n"),
    ),
    Case(
        "sft model missing",
        "never downloads",
        supervised(
            "sft",
            lambda world, here: {"model": {"path": str(here / "none")}},
            data='{"prompt": "a", "response": "b"}\n',
        ),
    ),
    Case(
        "preference row without chosen",
        "data.jsonl, line 1: missing key 'chosen'",
        supervised("train-rm", data='{"prompt": "hi", "rejected": "bad"}\n'),
    ),
    Case(
        "preference pairs all identical",
        "no usable preference pairs",
        supervised("train-rm", data=json.dumps({"prompt": "hi", "chosen": "a", "rejected": "a"}) + "\n"),
    ),
    Case(
        "reward model base missing",
        "never downloads",
        supervised("train-rm", lambda world, here: {"model": {"path": str(here / "none")}}, data=PAIR + "\n"),
    ),
    Case(
        "eval a directory without a run",
        "config.yaml does not exist",
        lambda world, here: ["eval", str(here)],
    ),
    Case(
        "eval without held-out prompts",
        "no held-out prompts",
        lambda world, here: ["eval", str(world / "finished")],
    ),
    Case("report without metrics", "metrics.jsonl: train first", lambda world, here: ["report", str(here)]),
]


def snapshot(*roots: Path) -> dict[str, str]:
    return {
        str(path): hashlib.sha256(path.read_bytes()).hexdigest()
        for root in roots
        for path in sorted(root.rglob("*"))
        if path.is_file()
    }


def test_the_corpus_is_large_and_its_names_are_unique():
    assert len(CASES) >= 60 and len({c.name for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_is_one_clear_message_and_changes_nothing(case, world, tmp_path, capsys, recwarn):
    args = case.setup(world, tmp_path)
    before = snapshot(world, tmp_path)
    capsys.readouterr()
    code = run_cli(*args)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and err.startswith("error:"), err
    assert case.expected in " ".join(err.split()), err  # the console wraps long lines
    assert snapshot(world, tmp_path) == before  # nothing written, nothing lost
