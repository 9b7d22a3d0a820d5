"""Prompt and demonstration data: JSONL files or ``datasets`` directories, and a resumable prompt stream.

A prompt is either a string (rendered as one user turn) or a chat ``messages`` list
``[{"role": ..., "content": ...}, ...]``; both are rendered later with the tokenizer's own template.
"""

from __future__ import annotations

import csv
import importlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from jinja2 import TemplateError

from lmppo.errors import LmppoError, console, read_from

Prompt = str | list[dict[str, str]]  # plain user text, or a list of chat messages
# what follows a prompt in a demonstration: one response, or an episode's messages (the assistant's turns
# and what came between them: tool results, the user's next message), the last one the assistant's
Continuation = str | list[dict[str, str]]


def as_messages(prompt: Prompt) -> list[dict[str, str]]:
    """A prompt as chat messages: a plain string becomes one user turn."""
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)


def check_chat_template(tokenizer, chat_template: str | None) -> None:
    """A conversation needs a template: the override, or the tokenizer's own (a base model's has none)."""
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise LmppoError(
            f"the tokenizer of {getattr(tokenizer, 'name_or_path', '') or 'this model'} has no chat template "
            "(a base model's tokenizer often has none); give the model one in its config section "
            "(models.policy.chat_template, or the reward model's chat_template: a Jinja template), or let the "
            "policy read prompts as plain text with data.raw_prompts=true"
        )


def render_chat(
    tokenizer,
    messages: list[dict[str, str]],
    chat_template: str | None,
    *,
    add_generation_prompt: bool,
    tools: list[dict] | None = None,
) -> str:
    """The text of a conversation under the chat template (``chat_template`` overrides the tokenizer's),
    with the ``tools`` schemas where the template renders them, else in the system message
    (:func:`with_tools`)."""
    check_chat_template(tokenizer, chat_template)
    messages, tools = with_tools(tokenizer, chat_template, messages, tools)
    try:
        return tokenizer.apply_chat_template(
            messages,
            chat_template=chat_template,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
        )
    except TemplateError as err:
        roles = [m.get("role") for m in messages]
        raise LmppoError(
            f"the chat template refused a conversation with roles {roles}: {err}. Use the roles the model's "
            "template knows (usually system, user, assistant), or set the model's chat_template."
        ) from None


def with_tools(
    tokenizer, chat_template: str | None, messages: list[dict[str, str]], tools: list[dict] | None
) -> tuple[list[dict[str, str]], list[dict] | None]:
    """The messages and the ``tools=`` to render them with: as given where the template renders tools, else
    the schemas and the call format in the system message (merged into the first one, or a new first one)."""
    if not tools or renders_tools(tokenizer, chat_template):
        return messages, tools
    text = tools_system_text(tools)
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]], None
    return [{"role": "system", "content": text}, *messages], None


def tools_system_text(tools: list[dict]) -> str:
    """The tools and the Hermes call format, for a template that does not render ``tools=``."""
    listed = "\n".join(json.dumps(tool) for tool in tools)
    return (
        "You may call the functions below to help with the user's request.\n"
        f"<tools>\n{listed}\n</tools>\n"
        'To call one, write <tool_call>{"name": <function name>, "arguments": <arguments as a JSON object>}'
        "</tool_call>; its result comes back in the next message."
    )


_PROBE_TOOL = {
    "type": "function",
    "function": {"name": "probe", "description": "probe", "parameters": {"type": "object", "properties": {}}},
}
_RENDERS_TOOLS: dict[str, bool] = {}  # by template text: whether it renders tools=


def renders_tools(tokenizer, chat_template: str | None) -> bool:
    """Whether the template writes ``tools=`` into its text (one that ignores them renders the same without);
    a template found not to is noted once, as the schemas then go in the system message."""
    template = str(chat_template or tokenizer.chat_template)
    if template not in _RENDERS_TOOLS:
        probe = [{"role": "user", "content": "hi"}]
        texts = [
            tokenizer.apply_chat_template(probe, chat_template=chat_template, tools=tools, tokenize=False)
            for tools in ([_PROBE_TOOL], None)
        ]
        _RENDERS_TOOLS[template] = texts[0] != texts[1]
        if not _RENDERS_TOOLS[template]:
            name = getattr(tokenizer, "name_or_path", "") or "the policy"
            console(stderr=True).print(
                f"note: the chat template of {name} does not render tools=; the tool schemas and the "
                "<tool_call> format go in the system message instead",
                highlight=False,
            )
    return _RENDERS_TOOLS[template]


def encode_chat(
    tokenizer,
    messages: list[dict[str, str]],
    chat_template: str | None,
    *,
    add_generation_prompt: bool,
    tools: list[dict] | None = None,
) -> list[int]:
    """Token ids of a conversation in which only the template makes control tokens (:func:`encode_rendered`)."""
    return encode_rendered(
        tokenizer,
        messages,
        lambda shown: render_chat(
            tokenizer, shown, chat_template, add_generation_prompt=add_generation_prompt, tools=tools
        ),
    )


def encode_rendered(
    tokenizer, messages: list[dict[str, str]], render: Callable[[list[dict[str, str]]], str]
) -> list[int]:
    """Token ids of ``render(messages)``, a text the chat template made around ``messages``, in which only the
    template makes control tokens.

    A message whose text spells a special token (``<|im_end|>``, ``</s>``, ...) would otherwise become
    that control token and could forge a turn: prompt text opening an assistant turn, a tool's output or a
    response spelling an end of turn. Such text is tokenised as plain text, message by message, between the
    template's own pieces. Text without special tokens is tokenised in one piece.
    """
    specials = _special_token_texts(tokenizer)
    if not any(special in m["content"] for m in messages for special in specials):
        return tokenizer(render(messages), add_special_tokens=False)[
            "input_ids"
        ]  # the template holds any BOS
    marked = [{**m, "content": f"{_MARK}{i}{_MARK}"} for i, m in enumerate(messages)]
    ids = []
    for k, piece in enumerate(render(marked).split(_MARK)):
        if k % 2 == 0:  # the template's own text, control tokens included
            ids += tokenizer(piece, add_special_tokens=False)["input_ids"]
            continue
        content = messages[int(piece)]["content"]
        content_ids = tokenizer(content, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        forged = set(content_ids) & set(tokenizer.all_special_ids) | {
            i for i in content_ids if tokenizer.convert_ids_to_tokens(i) in specials
        }
        if forged:
            raise LmppoError(
                f"a {messages[int(piece)].get('role')} message spells the control token(s) "
                f"{sorted(tokenizer.convert_ids_to_tokens(i) for i in forged)}, which this tokenizer cannot "
                "encode as plain text; remove them from the text."
            )
        ids += content_ids
    return ids


def encode_context(
    tokenizer,
    chat_template: str | None,
    history: list[dict[str, str]],
    turn: str,
    stop_text: str,
    inserted: list[dict[str, str]],
    *,
    more_turns: bool,
    tools: list[dict] | None = None,
) -> list[int]:
    """Token ids of the context that follows a policy's turn in an episode: what the chat template writes
    after the turn's stop token, the ``inserted`` messages (an environment's), and the next generation
    prompt when ``more_turns``. ``history``: the conversation before the turn; ``turn``: the turn's text,
    whose own tokens (``stop_text`` last) are the sampled ones, never re-tokenised; ``tools``: the schemas
    every rendering of the episode carries.

    The context is the difference between the conversation rendered with and without it, so the template
    must extend a conversation by appending to its text; one that rewrites earlier turns (drops a reasoning
    block, moves a date) cannot hold an episode, and the error says so.
    """
    before = render_chat(tokenizer, history, chat_template, add_generation_prompt=True, tools=tools)
    ended = render_chat(
        tokenizer,
        [*history, {"role": "assistant", "content": turn}],
        chat_template,
        add_generation_prompt=False,
        tools=tools,
    )
    rendered_turn = _extension(before, ended, "an assistant turn")
    if stop_text not in rendered_turn:
        raise LmppoError(
            f"the chat template ends an assistant turn with {rendered_turn[-40:]!r}, without the stop token "
            f"{stop_text!r} the policy ended its turn with; give the policy a template that closes a turn with "
            "its stop token (models.policy.chat_template), or add that token to rollout.stop_token_ids"
        )
    glue = rendered_turn[rendered_turn.rindex(stop_text) + len(stop_text) :]  # after the sampled stop token

    def render(shown: list[dict[str, str]]) -> str:
        conversation = [*history, {"role": "assistant", "content": turn}, *shown]
        text = render_chat(
            tokenizer, conversation, chat_template, add_generation_prompt=more_turns, tools=tools
        )
        return glue + _extension(ended, text, "the environment's messages")

    return encode_rendered(tokenizer, inserted, render)


def _extension(text: str, extended: str, what: str) -> str:
    """What ``extended`` appends to ``text``; an error when it does not start with it."""
    if not extended.startswith(text):
        raise LmppoError(
            f"the chat template does not extend a conversation by appending {what}: it rewrites the text "
            "before it, so the tokens already sampled would not be what the policy sees. Give the policy a "
            "template that renders each turn the same whatever follows (models.policy.chat_template)"
        )
    return extended[len(text) :]


_MARK = "\u2063lmppo-message\u2063"  # stands for a message's text while the template renders (invisible separator)


def _special_token_texts(tokenizer) -> set[str]:
    """The text of every special (control) token of ``tokenizer``."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return {*tokenizer.all_special_tokens, *(t.content for t in added.values() if t.special)}


def render_query_ids(
    tokenizer, prompt: Prompt, chat_template: str | None = None, *, tools: list[dict] | None = None
) -> list[int]:
    """Token ids of a prompt as the policy sees it: its chat template with ``add_generation_prompt=True``
    (and the run's ``tools`` schemas).

    Rollouts and SFT both render with this, so the policy is trained and sampled on the same tokens.
    """
    return encode_chat(tokenizer, as_messages(prompt), chat_template, add_generation_prompt=True, tools=tools)


ROLES = ("system", "user", "assistant")


def _data_file(path: Path) -> Path:
    if path.is_dir():
        raise LmppoError(
            f"data file {path} is a directory; give the path of a JSONL file (one JSON object per line)"
        )
    if not path.is_file():
        raise LmppoError(f"data file {path} does not exist{read_from(path)}")
    return path


def located_jsonl(path: str | Path) -> list[tuple[str, dict[str, Any]]]:
    """``("FILE, line N", row)`` for every row of a JSONL file (blank lines skipped); a bad line is an
    error naming its number."""
    path = _data_file(Path(path))
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as err:
        line_no = path.read_bytes()[: err.start].count(b"\n") + 1
        raise LmppoError(
            f"{path}, line {line_no}: not UTF-8 text ({err.reason}); save the file as UTF-8"
        ) from None
    rows = []
    for line_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise LmppoError(f"{path}, line {line_no}: not valid JSON ({err.msg})") from None
        if not isinstance(row, dict):
            raise LmppoError(f"{path}, line {line_no}: each line must be a JSON object")
        rows.append((f"{path}, line {line_no}", row))
    return rows


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """All rows of a JSONL file (blank lines skipped); a bad line is an error naming its number."""
    return [row for _, row in located_jsonl(path)]


PromptSource = str | Path | list  # a file, a dataset directory or hub name, or the rows themselves


def _located_rows(source: PromptSource, split: str | None) -> list[tuple[str, dict[str, Any]]]:
    """Rows of prompt data with where each is: rows given inline (a string is a ``prompt``), a JSONL,
    Parquet or CSV file, a dataset saved with ``datasets``' ``save_to_disk``, or a hub dataset name."""
    if isinstance(source, list):
        return [
            (f"data.prompts item {i + 1}", row if isinstance(row, dict) else {"prompt": row})
            for i, row in enumerate(source)
        ]
    path = Path(source)
    if path.is_dir():
        return _dataset_dir_rows(path, split)
    if path.suffix == ".parquet":
        return _parquet_rows(_data_file(path))
    if path.suffix == ".csv":
        return _csv_rows(_data_file(path))
    if not path.exists() and _looks_like_hub_name(str(source)):
        return _hub_rows(str(source), split)
    return located_jsonl(path)


def _needs(what: str, package: str) -> None:
    """Import ``package``, which only some formats need (the GPU machine has no ``datasets``)."""
    try:
        importlib.import_module(package)
    except ImportError as err:
        raise LmppoError(
            f"{what}, and reading one needs the `{package.split('.')[0]}` package ({err}); install it "
            f"(pip install {package.split('.')[0]}) or give a JSONL file"
        ) from None


def _parquet_rows(path: Path) -> list[tuple[str, dict[str, Any]]]:
    _needs(f"{path} is a Parquet file", "pyarrow.parquet")
    import pyarrow
    import pyarrow.parquet

    try:
        rows = pyarrow.parquet.read_table(path).to_pylist()
    except (OSError, pyarrow.ArrowException) as err:
        raise LmppoError(
            f"cannot read {path} as Parquet ({err}); write it again or give a JSONL file"
        ) from None
    return [(f"{path}, row {i + 1}", row) for i, row in enumerate(rows)]


def _csv_rows(path: Path) -> list[tuple[str, dict[str, Any]]]:
    try:
        with path.open(newline="", encoding="utf-8") as f:
            rows = list(csv.DictReader(f))
    except (UnicodeDecodeError, csv.Error) as err:
        raise LmppoError(
            f"cannot read {path} as CSV ({err}); save it as UTF-8 CSV with a header row"
        ) from None
    return [(f"{path}, line {i + 2}", row) for i, row in enumerate(rows)]  # line 1 is the header


def _looks_like_hub_name(source: str) -> bool:
    """``owner/name``: two plain parts, no file suffix."""
    parts = source.split("/")
    return len(parts) == 2 and all(parts) and not Path(source).suffix and not source.startswith((".", "~"))


def _hub_rows(name: str, split: str | None) -> list[tuple[str, dict[str, Any]]]:
    """A dataset on the Hugging Face hub (needs the hub reachable, or the dataset in the local cache)."""
    _needs(f"{name} names a hub dataset", "datasets")
    import datasets

    try:
        ds = datasets.load_dataset(name, split=split or "train")
    except Exception as err:  # noqa: BLE001 - the hub's failures have many types; all mean the same here
        raise LmppoError(
            f"{name!r} is no local file, and loading it as a hub dataset failed ({type(err).__name__}: {err}); "
            "give a JSONL, Parquet or CSV file, a saved dataset directory, or a reachable hub dataset"
        ) from None
    return [(f"{name} ({split or 'train'}), row {i + 1}", dict(row)) for i, row in enumerate(ds)]


def _dataset_dir_rows(path: Path, split: str | None) -> list[tuple[str, dict[str, Any]]]:
    """Rows of a dataset saved with ``datasets``' ``save_to_disk``."""
    if not any((path / name).is_file() for name in ("dataset_info.json", "state.json", "dataset_dict.json")):
        raise LmppoError(
            f"{path} is a directory but not a dataset saved with datasets' save_to_disk (no state.json or "
            "dataset_dict.json in it); give a JSONL, Parquet or CSV file or such a directory"
        )
    _needs(f"{path} is a dataset directory", "datasets")
    import datasets
    import pyarrow

    try:
        ds = datasets.load_from_disk(str(path))
    except (OSError, ValueError, KeyError, pyarrow.ArrowException) as err:
        raise LmppoError(
            f"cannot read the dataset directory {path} ({type(err).__name__}: {err}); save it again "
            "with save_to_disk, or give a JSONL file"
        ) from None
    if isinstance(ds, datasets.DatasetDict):
        if split is None or split not in ds:
            raise LmppoError(f"{path} holds splits {list(ds)}; choose one with data.split")
        ds = ds[split]
    return [(f"{path}, row {i + 1}", dict(row)) for i, row in enumerate(ds)]


def prompt_of_row(
    row: dict[str, Any], where: str, key: str | None = None, knob: str = "data.prompt_key"
) -> Prompt:
    """The prompt of one row: column ``key``, else ``prompt`` or ``messages``; a string or a list of
    messages. Errors name ``where``, the columns the row has and ``knob``, where the user sets ``key``.

    Messages are ``{"role", "content"}`` turns with string content and a role in :data:`ROLES`; the last
    one may not be the assistant's (the generation prompt would open a second assistant turn).
    """
    if key is not None and key not in row:
        raise LmppoError(
            f"{where} has no column {key!r} ({knob}); its columns are {sorted(row)}: set {knob} to the one "
            "holding the prompt text or messages"
        )
    key = key or ("prompt" if "prompt" in row else "messages")
    prompt = row.get(key)
    if isinstance(prompt, str) and prompt.strip() and key != "messages":
        return prompt
    if isinstance(prompt, list) and prompt:
        return _checked_messages(prompt, where, key)
    raise LmppoError(
        f"{where} has no prompt: each row needs a non-empty 'prompt' string or a 'messages' list of "
        f"{{'role', 'content'}} turns, or {knob} naming the column that holds one (its columns: "
        f"{sorted(row)})"
    )


def _checked_messages(messages: list, where: str, key: str) -> list[dict[str, str]]:
    for turn, message in enumerate(messages, start=1):
        if not (isinstance(message, dict) and isinstance(message.get("content"), str)):
            raise LmppoError(
                f"{where}: {key} turn {turn} must be a {{'role', 'content'}} object with string content"
            )
        if message.get("role") not in ROLES:
            raise LmppoError(
                f"{where}: {key} turn {turn} has role {message.get('role')!r}; use one of {list(ROLES)}"
            )
    if messages[-1]["role"] == "assistant":
        raise LmppoError(
            f"{where}: the {key} end with an assistant turn, so the generation prompt would open a second "
            "one; end the prompt with the user's (or system's) turn"
        )
    return messages


def load_located_prompts(
    source: PromptSource, split: str | None = None, key: str | None = None, knob: str = "data.prompt_key"
) -> list[tuple[str, Prompt]]:
    """``(where, prompt)`` of every row: ``where`` names the file and line (or dataset row) for errors;
    ``key`` is the column holding the prompt, set by ``knob`` (the config key, or ``lmppo init``'s flag)."""
    rows = _located_rows(source, split)
    if not rows:
        raise LmppoError(f"{_name(source)} holds no prompts")
    return [(where, prompt_of_row(row, where, key, knob)) for where, row in rows]


def load_prompt_rows(source: PromptSource, split: str | None = None) -> list[dict[str, Any]]:
    """Every prompt row whole, all its columns, in file order: what an environment resets on."""
    return [row for _, row in _located_rows(source, split)]


def load_prompts(
    source: PromptSource, split: str | None = None, key: str | None = None, knob: str = "data.prompt_key"
) -> list[Prompt]:
    return [prompt for _, prompt in load_located_prompts(source, split, key, knob)]


def _name(source: PromptSource) -> str:
    return "data.prompts (given as rows)" if isinstance(source, list) else str(source)


def prompt_slices(source: PromptSource, split: str | None, key: str | None) -> list[str] | None:
    """Each prompt row's ``key`` field as a string (its slice: task type, source), in file order; None
    when ``key`` is None or some row lacks it."""
    rows = [row for _, row in _located_rows(source, split)] if key else []
    return [str(row[key]) for row in rows] if rows and all(key in row for row in rows) else None


def load_demonstrations(path: str | Path) -> list[tuple[Prompt, Continuation]]:
    """``(prompt, continuation)`` pairs for SFT and PPO-ptx: a row's prompt and ``response`` string, or a
    row's ``messages`` alone, a whole episode: the prompt is what comes before the assistant's first turn,
    the continuation the rest (tool results and the user's turns between the assistant's are context)."""
    pairs = []
    for where, row in located_jsonl(path):
        response = row.get("response")
        if isinstance(response, str):
            pairs.append((prompt_of_row(row, where), response))
        elif response is None and isinstance(row.get("messages"), list):
            pairs.append(_episode_demonstration(row["messages"], where))
        else:
            raise LmppoError(
                f"{where} has no 'response' string, nor 'messages' that end with the assistant's turn (keys "
                f"found: {sorted(row)})"
            )
    if not pairs:
        raise LmppoError(
            f"{path} holds no demonstrations; each line must be a JSON object with 'prompt' and 'response', or "
            "'messages' ending with the assistant's turn"
        )
    return pairs


def _episode_demonstration(messages: list, where: str) -> tuple[Prompt, list[dict[str, str]]]:
    """A demonstrated episode's prompt (the messages before the assistant's first turn) and the rest."""
    roles = (*ROLES, "tool")
    for turn, message in enumerate(messages, start=1):
        if (
            not (isinstance(message, dict) and isinstance(message.get("content"), str))
            or message.get("role") not in roles
        ):
            raise LmppoError(
                f"{where}: messages turn {turn} must be a {{'role', 'content'}} object with string content "
                f"and a role in {list(roles)}"
            )
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
    if not first or messages[-1]["role"] != "assistant":
        raise LmppoError(
            f"{where}: a demonstrated episode's messages start with the prompt (a user's turn) and end with "
            "the assistant's turn"
        )
    return messages[:first], messages[first:]


@dataclass
class PromptBatch:
    """This rank's prompts of one step and each sample's id: its place in the whole stream (epochs included)."""

    prompts: list[Prompt]
    sample_ids: list[int]
    rows: list[dict[str, Any]]  # each prompt's whole row: what an environment resets on


class PromptStream:
    """Batches of prompts, reshuffled each epoch from ``seed + epoch``; resumable from ``(epoch, cursor)``.

    With several ranks every rank walks the same global order and takes its own slice of each global
    batch, so the union over ranks of one step is the batch a single process would take. Each prompt
    comes ``samples_per_prompt`` times in a row: one group, always on one rank.
    """

    def __init__(
        self,
        prompts: list[Prompt],
        batch_size: int,
        *,
        samples_per_prompt: int = 1,
        shuffle: bool,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        rows: list[dict[str, Any]] | None = None,
    ) -> None:
        if batch_size % world_size:
            raise LmppoError(f"rollout.batch_size={batch_size} must be divisible by the {world_size} ranks")
        if batch_size > len(prompts):
            raise LmppoError(f"rollout.batch_size={batch_size} is larger than the {len(prompts)} prompts")
        self.prompts = prompts
        self.rows = [{"prompt": prompt} for prompt in prompts] if rows is None else rows
        self.batch_size, self.shuffle, self.seed = batch_size, shuffle, seed
        self.samples_per_prompt = samples_per_prompt
        self.rank, self.world_size = rank, world_size
        self.epoch, self.cursor = 0, 0

    def _order(self) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.prompts)))
        return torch.randperm(
            len(self.prompts), generator=torch.Generator().manual_seed(self.seed + self.epoch)
        ).tolist()

    def next_batch(self) -> list[Prompt]:
        """This rank's share of the next global batch, each prompt repeated ``samples_per_prompt`` times
        in a row (a short tail of an epoch is skipped)."""
        return self.next_samples().prompts

    def next_samples(self) -> PromptBatch:
        """:meth:`next_batch` with each sample's place in the stream (its id: the same on any number of ranks)."""
        if self.cursor + self.batch_size > len(self.prompts):
            self.epoch, self.cursor = self.epoch + 1, 0
        order = self._order()[self.cursor : self.cursor + self.batch_size]
        per_rank = self.batch_size // self.world_size
        first = (
            self.epoch * len(self.prompts) + self.cursor + self.rank * per_rank
        ) * self.samples_per_prompt
        self.cursor += self.batch_size
        mine = order[self.rank * per_rank : (self.rank + 1) * per_rank]
        picked = [i for i in mine for _ in range(self.samples_per_prompt)]
        sample_ids = list(range(first, first + len(picked)))
        return PromptBatch([self.prompts[i] for i in picked], sample_ids, [self.rows[i] for i in picked])

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
