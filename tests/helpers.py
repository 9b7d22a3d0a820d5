"""What several test modules build: tiny word-level tokenizers and Llamas, the seeds' toy reward, a toy
trainer, config files and the CLI. Fixtures that wrap these live in ``conftest.py``.

Nothing is downloaded. Models are 2-layer Llamas with hidden size 32, so a forward pass takes milliseconds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import torch
import yaml
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from lmppo.inputs.config import load_config
from lmppo.inputs.resolve import resolve
from lmppo.modeling.distributed import seed_everything
from lmppo.modeling.lora import make_reference
from lmppo.modeling.models import PPOModels, ValueModel
from lmppo.rewards.scoring import load_reward_function
from lmppo.runs.build import build_trainer
from lmppo.training.trainer import PPOTrainer

WORDS = [
    "good",
    "bad",
    "fine",
    "nice",
    "cat",
    "dog",
    "sun",
    "rain",
    "tree",
    "bird",
    "a",
    "the",
    "is",
    "very",
    "happy",
    "sad",
    "tell",
    "me",
    "about",
    "write",
    "short",
    "story",
    "poem",
    "day",
    "night",
    "red",
    "blue",
    "one",
    "two",
    "three",
    "and",
    "or",
    "not",
    "it",
    "was",
]
POLICY_SPECIALS = ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|end|>", "<unk>"]
# Turns end with EOS, as in ChatML-style templates (so with pad == EOS the prompt holds pad-id tokens).
POLICY_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{{ '<|user|>' if m['role'] == 'user' else '<|assistant|>' }} {{ m['content'] }} {{ eos_token }} "
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# A template with a turn for each role, tool included, each turn ended by EOS (the policy's stop token):
# what multi-turn episodes and their demonstrations are rendered with.
ROLE_SPECIALS = ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|tool|>", "<unk>"]
ROLE_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{{ '<|' + m['role'] + '|>' }} {{ m['content'] }} {{ eos_token }} "
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# The reward model's own, different special tokens and template.
REWARD_SPECIALS = ["[PAD]", "[EOS]", "[Q]", "[A]", "<unk>"]
REWARD_TEMPLATE = "{% for m in messages %}{{ '[Q]' if m['role'] == 'user' else '[A]' }} {{ m['content'] }} {% endfor %}{{ eos_token }}"


def role_tokenizer():
    """The word-level tokenizer of :data:`WORDS` with :data:`ROLE_TEMPLATE`."""
    return build_tokenizer(
        ROLE_SPECIALS, WORDS, pad="<pad>", eos="</s>", bos="<s>", chat_template=ROLE_TEMPLATE
    )


def build_tokenizer(
    specials: list[str],
    words: list[str],
    *,
    pad: str,
    eos: str,
    bos: str | None = None,
    chat_template: str | None = None,
) -> PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer: ids are ``specials + words`` in order."""
    vocab = {token: i for i, token in enumerate(specials + words)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    extra = [t for t in specials if t not in {pad, eos, bos, "<unk>"}]
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=pad,
        eos_token=eos,
        bos_token=bos,
        unk_token="<unk>",
        extra_special_tokens=extra,
    )
    tokenizer.chat_template = chat_template
    return tokenizer


def llama_config(tokenizer, **overrides) -> LlamaConfig:
    settings = {
        "vocab_size": len(tokenizer),
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "tie_word_embeddings": False,
    }
    return LlamaConfig(**{**settings, **overrides})


def boost_token(model: LlamaForCausalLM, token_id: int, logit: float) -> LlamaForCausalLM:
    """Add ``logit`` to one vocabulary entry's logit everywhere (a biased output layer)."""
    head = model.lm_head
    biased = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    biased.weight.data.copy_(head.weight.data)
    biased.bias.data.zero_()
    biased.bias.data[token_id] = logit
    model.lm_head = biased
    return model


# --------------------------------------------------------------------------------------------------
# The seeds' toy reward and a toy PPO trainer
# --------------------------------------------------------------------------------------------------


def count_good(prompts: Sequence, responses: Sequence[str]) -> list[float]:
    """The seeds' toy reward: how many times the word "good" occurs in each response (any case)."""
    return [float(len(re.findall(r"\bgood\b", response.lower()))) for response in responses]


# ``reward.function`` naming count_good by file, so runs in subprocesses (torchrun, signals) find it too
COUNT_GOOD = f"{Path(__file__).resolve()}:count_good"
PROMPTS = ["tell me about the cat", "write a short poem", "tell me a story", "the day was very happy"]
BASE = {
    "models": {"policy": {"path": "unused"}, "value": {"init_from": "policy"}},
    "reward": {"function": COUNT_GOOD},
    "data": {"prompts": "unused"},
}


def toy_models(seed: int = 0, head_scale: float = 0.01) -> PPOModels:
    """A tiny Llama whose next-token distribution is near uniform (the seeds' near-uniform reference)."""
    tokenizer = build_tokenizer(
        POLICY_SPECIALS, list(WORDS), pad="<pad>", eos="</s>", bos="<s>", chat_template=POLICY_TEMPLATE
    )
    torch.manual_seed(seed)
    policy = LlamaForCausalLM(llama_config(tokenizer))
    with torch.no_grad():
        policy.lm_head.weight.mul_(head_scale)
    reward = load_reward_function(COUNT_GOOD)
    return PPOModels(policy, make_reference(policy), ValueModel.from_causal_lm(policy), tokenizer, reward)


def toy_trainer(*overrides: str, models: PPOModels | None = None, **kwargs) -> PPOTrainer:
    cfg = load_config(
        base=BASE,
        overrides=[
            "run.precision=fp32",  # what the tolerances are for, on any CPU (in a spawned rank too)
            "rollout.max_new_tokens=8",
            "rollout.batch_size=8",
            "ppo.minibatch_size=4",
            "ppo.ppo_epochs=2",
            "ppo.lr=3e-3",
            *overrides,
        ],
    )
    seed_everything(cfg.run.seed)
    spec = resolve(cfg, device="cpu", world_size=kwargs.pop("world_size", 1))
    models = models or toy_models()
    if spec.value is None:  # a critic-free estimator: the run has no value model
        models = dataclasses.replace(models, value=None)
    return build_trainer(cfg, spec, models, PROMPTS * 4, **kwargs)


def signal_on_cats(prompts, responses) -> torch.Tensor:
    """Responses to the cat and happy-day prompts score apart; the poem and story ones all score 1."""
    return torch.tensor(
        [
            float(sum(map(ord, r)) % 97) if ("cat" in str(p) or "happy" in str(p)) else 1.0
            for p, r in zip(prompts, responses)
        ]
    )


def scored_by(function):
    """The toy models with ``function`` as the one reward component."""
    from lmppo.rewards.scoring import CombinedReward, ScoredComponent  # noqa: PLC0415

    return dataclasses.replace(toy_models(), reward=CombinedReward([ScoredComponent("r", function)]))


DYNAMIC_SAMPLING = ("rollout.samples_per_prompt=2", "rollout.dynamic_sampling=true", "ppo.advantage=grpo")


# --------------------------------------------------------------------------------------------------
# Runs through the CLI
# --------------------------------------------------------------------------------------------------

UNTIMED = ("perf/", "lag/rollout_age_s")


def comparable(records):
    """Metric records without wall-clock figures: what two runs of the same config must agree on."""
    return [{k: v for k, v in r.items() if k != "time" and not k.startswith(UNTIMED)} for r in records]


def write_config(path, **sections):
    """A copy of the config at ``path`` with ``sections``' keys updated, beside it; returns its path."""
    config = yaml.safe_load(path.read_text())
    for section, values in sections.items():
        config.setdefault(section, {}).update(values)
    out = path.parent / f"config-{len(list(path.parent.glob('config-*')))}.yaml"
    out.write_text(yaml.safe_dump(config))
    return out


# ``torchrun --standalone --nproc-per-node 2 -m lmppo``: torchrun's module form, as in the docs
TORCHRUN_LMPPO = [
    sys.executable,
    "-m",
    "torch.distributed.run",
    "--standalone",
    "--nproc-per-node",
    "2",
    "-m",
    "lmppo",
]


def torchrun(*args: str) -> subprocess.CompletedProcess:
    """``lmppo ppo ARGS --quiet`` on 2 ranks (:data:`TORCHRUN_LMPPO`)."""
    command = [*TORCHRUN_LMPPO, "ppo", *args, "--quiet"]
    return subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
    )


def run_cli(*args: str) -> int:
    """``lmppo ARGS`` in this process; returns the exit code."""
    from lmppo.interface.cli import main

    argv, sys.argv = sys.argv, ["lmppo", *args]
    try:
        main()
    except SystemExit as exit_:
        return int(exit_.code or 0)
    finally:
        sys.argv = argv
    return 0


_scored_batches = 0


def count_good_until_rank1_dies(prompts: Sequence, responses: Sequence[str]) -> list[float]:
    """:func:`count_good`, except that rank 1 SIGKILLs itself in the middle of its third step (scoring;
    its first batch is the reward pre-flight's), once: the file ``$LOST_RANK_MARKER`` is created first, and
    a run that finds it scores normally."""
    global _scored_batches
    _scored_batches += 1
    marker = Path(os.environ.get("LOST_RANK_MARKER", "/nonexistent/marker"))
    if os.environ.get("RANK") == "1" and _scored_batches == 4 and not marker.exists():
        marker.touch()
        os.kill(os.getpid(), signal.SIGKILL)
    return count_good(prompts, responses)


LOSES_RANK1 = f"{Path(__file__).resolve()}:count_good_until_rank1_dies"


def count_good_but_rank1_fails(prompts: Sequence, responses: Sequence[str]) -> list[float]:
    """:func:`count_good`, except that rank 1 raises in its second scoring (the first PPO step's)."""
    global _scored_batches
    _scored_batches += 1
    if os.environ.get("RANK") == "1" and _scored_batches == 2:
        raise ValueError("rank 1's reward service is down")
    return count_good(prompts, responses)


FAILS_ON_RANK1 = f"{Path(__file__).resolve()}:count_good_but_rank1_fails"


def good_judge(prompt, response: str) -> float:
    """A held-out judge (``data.eval_judge``): :func:`count_good` of one response."""
    return count_good([prompt], [response])[0]


GOOD_JUDGE = f"{Path(__file__).resolve()}:good_judge"


# --------------------------------------------------------------------------------------------------
# A fixed batch of token ids and the logits a model gives it
# --------------------------------------------------------------------------------------------------

INPUT_IDS = torch.tensor([[1, 3, 7, 9, 12, 4, 20], [1, 3, 8, 8, 30, 4, 22]])


def logits(model, input_ids=INPUT_IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=input_ids).logits


# --------------------------------------------------------------------------------------------------
# Reward servers on 127.0.0.1
# --------------------------------------------------------------------------------------------------


def serving(server: HTTPServer):
    """Serve in a thread; returns the URL."""
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_port}/score"


def fake_server(answers: list):
    """A server answering each request with the next of ``answers``: (status, body) or a delay in s."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            answer = answers.pop(0) if answers else (200, {"rewards": count_good(None, request["responses"])})
            if isinstance(answer, float):
                time.sleep(answer)
                answer = (200, {"rewards": [0.0] * len(request["responses"])})
            status, body = answer
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except BrokenPipeError:  # the client gave up waiting: what the timeout test wants
                pass

        def log_message(self, *args):
            pass

    return HTTPServer(("127.0.0.1", 0), Handler)


@contextlib.contextmanager
def serve_rm_process(model: str, *flags: str):
    """A real ``lmppo serve-rm`` process on a free port of 127.0.0.1; yields (base URL, its pid)."""
    server = subprocess.Popen(
        [sys.executable, "-m", "lmppo", "serve-rm", model, "--port", "0", *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        line = server.stdout.readline()  # "scoring with MODEL on http://127.0.0.1:PORT/score ..."
        match = re.search(r"http://127\.0\.0\.1:(\d+)/score", line)
        assert match, f"serve-rm did not start: {line!r}"
        yield f"http://127.0.0.1:{match[1]}", server.pid
    finally:
        server.terminate()
        server.wait(30)


def peer_socket(address: str, port: int) -> socket.socket:
    """A connection to 127.0.0.1:``port`` from ``address`` (any of 127.0.0.0/8: another peer)."""
    return socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(address, 0))


def resident_mb(pid: int, field: str = "VmRSS") -> float:
    """A process's resident memory now (VmRSS) or at its peak (VmHWM), from /proc, in MB."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(rf"{field}:\s+(\d+) kB", status)[1]) / 1024
