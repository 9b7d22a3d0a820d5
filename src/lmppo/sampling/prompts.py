"""Prompts as every engine sees them, and responses as a user reads them: :class:`PromptRenderer`, the one
piece both the single-turn generator and the episode player render with, whatever engine samples.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedTokenizerBase

from lmppo.errors import LmppoError
from lmppo.inputs.data import Prompt, check_chat_template, encode_context, render_query_ids


def prompt_room(
    context: int | None,
    max_new_tokens: int,
    max_prompt_length: int | None,
    key: str = "rollout.max_new_tokens",
) -> int | None:
    """Tokens a rendered prompt may take in a ``context``-token window (None: no limit known) next to
    ``max_new_tokens`` of response (the config's ``key``; an episode's: ``rollout.max_total_tokens``):
    ``data.max_prompt_length`` when set, else the rest of the window."""
    if context is not None and max_new_tokens >= context:
        raise LmppoError(
            f"{key}={max_new_tokens} leaves no room for a prompt in the policy's {context}-token context window "
            f"(max_position_embeddings); set {key} below {context}"
        )
    room = None if context is None else context - max_new_tokens
    if max_prompt_length is None:
        return room
    if room is not None and max_prompt_length > room:
        raise LmppoError(
            f"data.max_prompt_length={max_prompt_length} + {key}={max_new_tokens} exceeds the policy's "
            f"{context}-token context window; lower one of them"
        )
    return max_prompt_length


class PromptRenderer:
    """Renders prompts with the tokenizer's own chat template (or ``chat_template``) and
    ``add_generation_prompt=True``; ``raw_prompts=True`` tokenises prompt strings as they are. A rendered
    prompt longer than ``max_prompt_length`` (:func:`prompt_room`: by default the ``context`` window minus
    ``max_new_tokens``) is an error naming the row, unless ``truncate_prompts`` keeps its last tokens.
    ``tools``: the run's tool schemas (``rollout.tools``), in every rendering, an episode's context included."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        *,
        pad_token_id: int,
        context: int | None,
        max_new_tokens: int,
        chat_template: str | None = None,
        raw_prompts: bool = False,
        max_prompt_length: int | None = None,
        truncate_prompts: bool = False,
        tools: list[dict] | None = None,
    ) -> None:
        if not raw_prompts:
            check_chat_template(tokenizer, chat_template)
        self.tokenizer, self.pad_token_id = tokenizer, pad_token_id
        self.chat_template, self.raw_prompts, self.truncate_prompts = (
            chat_template,
            raw_prompts,
            truncate_prompts,
        )
        self.max_new_tokens, self.tools = max_new_tokens, tools
        self.max_prompt_length = prompt_room(context, max_new_tokens, max_prompt_length)

    def render(self, prompt: Prompt) -> list[int]:
        """Token ids of one prompt, ready for generation (chat template with the generation prompt)."""
        if self.raw_prompts:
            if not isinstance(prompt, str):
                raise LmppoError("raw_prompts needs plain-text prompts, got chat messages.")
            return self.tokenizer(prompt).input_ids
        return render_query_ids(self.tokenizer, prompt, self.chat_template, tools=self.tools)

    def context_ids(
        self, history: list[dict[str, str]], turn: str, stop_text: str, inserted: list[dict[str, str]]
    ) -> list[int]:
        """Token ids of what follows an episode's ``turn`` up to the next generation prompt: the template's
        end of the turn and the environment's ``inserted`` messages (:func:`encode_context`)."""
        return encode_context(
            self.tokenizer,
            self.chat_template,
            history,
            turn,
            stop_text,
            inserted,
            more_turns=True,
            tools=self.tools,
        )

    def query_ids(self, prompt: Prompt, where: str) -> list[int]:
        """The ids generation starts from: rendered, checked, cut to ``max_prompt_length`` if allowed.
        ``where`` names the prompt in errors (a file and line, when the caller knows them)."""
        ids = self.render(prompt)
        if not ids:
            raise LmppoError(f"{where} renders to no tokens; the model needs at least one to condition on.")
        if self.max_prompt_length is not None and len(ids) > self.max_prompt_length:
            if not self.truncate_prompts:
                raise LmppoError(
                    f"{where} is {len(ids)} tokens after rendering, over the limit of {self.max_prompt_length} "
                    f"(context window minus max_new_tokens={self.max_new_tokens}). Shorten it, or set "
                    "`data.truncate_prompts: true` to keep its last tokens."
                )
            ids = ids[-self.max_prompt_length :]  # keep the end: it holds the generation prompt
        return ids

    def query_batch(self, prompts: Sequence[Prompt]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(query_ids, query_mask)`` of a batch of prompts, left-padded."""
        if not prompts:
            raise LmppoError("no prompts to generate from.")
        rows = [self.query_ids(prompt, where=f"prompt {i} of the batch") for i, prompt in enumerate(prompts)]
        return self.left_padded(rows)

    def left_padded(self, rows: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(query_ids, query_mask)``, each (B, longest row), the rows left-padded."""
        width = max(len(ids) for ids in rows)
        query_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        query_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, ids in enumerate(rows):
            query_ids[i, width - len(ids) :] = torch.tensor(ids)
            query_mask[i, width - len(ids) :] = 1
        return query_ids, query_mask

    def response_texts(self, response_ids: torch.Tensor, lengths: torch.Tensor) -> list[str]:
        """Each row's first ``lengths`` response tokens as text, special tokens dropped (what a user sees)."""
        rows = [ids[:n].tolist() for ids, n in zip(response_ids, lengths.long())]
        return self.tokenizer.batch_decode(rows, skip_special_tokens=True)
