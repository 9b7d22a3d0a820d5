"""Tools as functions and schemas (lmppo.sampling.tools, ``rollout.tools``): sources, the toolbox, the schemas
every rendering carries, the calls read from a turn, and episodes answered from the toolbox alone."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from helpers import llama_config, run_cli
from transformers import LlamaForCausalLM

from lmppo.errors import LmppoError
from lmppo.inputs.data import render_chat, tools_system_text
from lmppo.sampling.environments import ToolEnvironment, with_toolbox
from lmppo.sampling.episodes import EpisodeGenerator
from lmppo.sampling.hf_engine import hf_generator
from lmppo.sampling.tools import UNCLOSED, open_toolbox, parse_tool_calls
from lmppo.toy.tokenizer import POLICY_TEMPLATE, tools_tokenizer

TOOLS_FILE = '''
def add(a: int, b: int) -> int:
    """Add two whole numbers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


def shout(text: str) -> str:
    """Say it loudly.

    Args:
        text: what to say
    """
    raise RuntimeError("too loud")


def undocumented(a: int) -> int:
    return a


def untyped(a):
    """Untyped.

    Args:
        a: anything
    """
    return a
'''

# Qwen2.5's shape: ChatML turns, the schemas in the system turn when tools are given. A turn ends with the
# tokenizer's EOS (the toy policy's stop token) where Qwen writes <|im_end|>.
QWEN_STYLE_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>{{ eos_token }}\n"
    "{% elif messages[0]['role'] == 'system' %}<|im_start|>system\n{{ messages[0]['content'] }}{{ eos_token }}\n"
    "{% endif %}"
    "{% for m in messages if m['role'] != 'system' %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture
def tools_file(tmp_path):
    path = tmp_path / "my_tools.py"
    path.write_text(TOOLS_FILE)
    return path


@pytest.fixture(scope="module")
def tokenizer():
    return tools_tokenizer(["what is 2 plus 3?", "5", "2 plus 3 is 5."])


def test_a_python_function_reaches_a_tools_aware_template_as_its_schema(tools_file, tokenizer):
    toolbox = open_toolbox([f"{tools_file}:add"], timeout_s=5.0)
    function = toolbox.sources[f"{tools_file}:add"].tool.function
    messages = [{"role": "user", "content": "what is 2 plus 3?"}]
    rendered = render_chat(
        tokenizer, messages, QWEN_STYLE_TEMPLATE, add_generation_prompt=True, tools=toolbox.schemas()
    )
    expected = tokenizer.apply_chat_template(
        messages,
        tools=[function],
        chat_template=QWEN_STYLE_TEMPLATE,
        add_generation_prompt=True,
        tokenize=False,
    )
    assert rendered == expected and '"name": "add"' in rendered and "the first number" in rendered


def test_a_template_that_ignores_tools_gets_them_in_the_system_message(tools_file, tokenizer, capsys):
    schemas = open_toolbox([f"{tools_file}:add"], timeout_s=5.0).schemas()
    template = "{# a template of its own #}" + POLICY_TEMPLATE.replace("'tool'", "'tool', 'system'")
    user = {"role": "user", "content": "what is 2 plus 3?"}
    alone = render_chat(tokenizer, [user], template, add_generation_prompt=True, tools=schemas)
    assert alone.startswith("<|system|>" + tools_system_text(schemas)) and "<tool_call>{" in alone
    merged = render_chat(
        tokenizer,
        [{"role": "system", "content": "Be terse."}, user],
        template,
        add_generation_prompt=True,
        tools=schemas,
    )
    assert merged.startswith("<|system|>Be terse.\n\n" + tools_system_text(schemas))
    assert capsys.readouterr().err.count("does not render tools=") == 1  # noted once per template
    assert (
        render_chat(tokenizer, [user], template, add_generation_prompt=True)
        == "<|user|>what is 2 plus 3?<|assistant|>"
    )


@pytest.mark.slow
def test_smollm2s_template_gets_the_schemas_in_a_system_message(tools_file):
    from test_smollm2 import CACHE_DIR, smollm2_gguf
    from transformers import AutoTokenizer

    from lmppo.modeling.loading import cache_gguf_as_transformers

    smollm2 = AutoTokenizer.from_pretrained(cache_gguf_as_transformers(smollm2_gguf(), CACHE_DIR))
    toolbox = open_toolbox([f"{tools_file}:add"], timeout_s=5.0)
    schemas, function = toolbox.schemas(), toolbox.sources[f"{tools_file}:add"].tool.function
    user = {"role": "user", "content": "hi"}
    rendered = render_chat(smollm2, [user], None, add_generation_prompt=True, tools=schemas)
    # the template's own rendering, called directly with the function: it ignores tools=, so the schemas
    # (transformers' own, from the function's hints and docstring) come as the system message
    system = {"role": "system", "content": tools_system_text(schemas)}
    direct = smollm2.apply_chat_template(
        [system, user], tools=[function], add_generation_prompt=True, tokenize=False
    )
    assert rendered == direct and '"description": "the first number"' in rendered
    assert rendered.startswith("<|im_start|>system\n" + tools_system_text(schemas) + "<|im_end|>")
    assert "named SmolLM" not in rendered  # the template's default system message is replaced, not doubled


def test_the_toolbox_answers_by_name_and_turns_failures_into_errors(tools_file):
    toolbox = open_toolbox([f"{tools_file}:add", f"{tools_file}:shout"], timeout_s=5.0)
    assert [schema["function"]["name"] for schema in toolbox.schemas()] == ["add", "shout"]
    assert toolbox.call("add", {"a": 2, "b": 3}) == ("5", False)
    assert toolbox.call("shout", {"text": "hi"}) == ("error: RuntimeError: too loud", True)
    assert toolbox.call("mul", {}) == ("error: no tool 'mul'; the tools are ['add', 'shout']", True)


@pytest.mark.parametrize(
    ("name", "error"),
    [
        (
            "undocumented",
            r"rollout.tools '.*:undocumented': its JSON schema cannot be made .*no docstring.*'Args:'",
        ),
        ("untyped", r"rollout.tools '.*:untyped': its JSON schema cannot be made .*type hint"),
        ("missing", r"rollout.tools '.*:missing': module .* has no attribute 'missing'"),
    ],
)
def test_a_function_without_a_schema_is_refused_naming_the_spec(tools_file, name, error):
    with pytest.raises(LmppoError, match=error):
        open_toolbox([f"{tools_file}:{name}"], timeout_s=5.0)


def test_two_tools_of_one_name_are_refused_naming_both_specs(tools_file, tmp_path):
    (tmp_path / "other.py").write_text(TOOLS_FILE)
    with pytest.raises(
        LmppoError, match=r"two tools are named 'add', from '.*my_tools.py:add' and '.*other.py:add'"
    ):
        open_toolbox([f"{tools_file}:add", f"{tmp_path}/other.py:add"], timeout_s=5.0)


def test_an_environment_with_tools_must_answer_tool_calls(tools_file):
    class Plain:
        def reset(self, row, seed): ...

        def step(self, text): ...

    class Own(ToolEnvironment):
        tools = {"add": lambda a, b: a - b}

    toolbox = open_toolbox([f"{tools_file}:add"], timeout_s=5.0)
    with pytest.raises(LmppoError, match="Plain is not a lmppo.sampling.environments.ToolEnvironment"):
        with_toolbox(Plain, toolbox, None)
    with pytest.raises(LmppoError, match=r"\['add'\] are both in Own.tools and rollout.tools"):
        with_toolbox(Own, toolbox, None)


def test_an_unclosed_call_is_a_failed_call(tokenizer):
    well_formed = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    assert parse_tool_calls(well_formed) == [("add", {"a": 1, "b": 2}, None)]
    calls = parse_tool_calls(well_formed + ' then <tool_call>{"name": "add", "arguments": {}}')
    assert calls[0].error is None and calls[1].error == UNCLOSED


RESPONSE_TEMPLATE = {  # transformers' Qwen2 response template, its tool calls only
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {
            "open_pattern": r"\s*<tool_call>",
            "close": "</tool_call>",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"\s*<\|im_end\|>", "content": "text"},
    },
}


def test_a_tokenizer_with_a_response_template_parses_calls_in_its_format(tools_file):
    tokenizer = tools_tokenizer(["what is 2 plus 3?"])
    tokenizer.response_template = RESPONSE_TEMPLATE
    schemas = open_toolbox([f"{tools_file}:add"], timeout_s=5.0).schemas()
    call = '<tool_call>\n{"name": "add", "arguments": {"a": "2", "b": 3}}\n</tool_call>'
    assert parse_tool_calls(call, tokenizer, schemas) == [("add", {"a": 2, "b": 3}, None)]  # cast to int
    assert parse_tool_calls(call[: -len("</tool_call>")], tokenizer, schemas)[0].error == UNCLOSED
    assert parse_tool_calls("<tool_call>{nope}</tool_call>", tokenizer, schemas)[0].error.startswith("error:")
    assert parse_tool_calls("just text", tokenizer, schemas) == []


class ScriptedTurns:
    """The toy decode loop, its turns scripted: turn k of every episode is ``turns[k]``'s tokens."""

    def __init__(self, engine, turns: list[list[int]]):
        self.engine, self.turns = engine, turns

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def sample(self, query_ids, query_mask, sample_ids, max_new_tokens, turn):
        ids = torch.tensor([self.turns[turn]] * len(query_ids))
        return ids, torch.zeros(ids.shape), None


def scripted_tool_episodes(toolbox, tokenizer) -> EpisodeGenerator:
    """Episodes on the toy model whose first turn calls add(2, 3) and whose second answers, the toolbox's
    schemas rendered by a tools-aware template."""
    model = LlamaForCausalLM(llama_config(tokenizer, max_position_embeddings=2048))  # room for the schemas
    generator = hf_generator(model, tokenizer, max_new_tokens=40, chat_template=QWEN_STYLE_TEMPLATE)
    generator.renderer.tools = toolbox.schemas()
    call = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    eos = [tokenizer.eos_token_id]
    turns = [tokenizer(call).input_ids + eos, tokenizer("2 plus 3 is 5.").input_ids + eos]
    return EpisodeGenerator(
        ScriptedTurns(generator.engine, turns),
        generator.renderer,
        with_toolbox(ToolEnvironment, toolbox, tokenizer),
        name="tools",
        max_turns=3,
        max_total_tokens=200,
        seed=0,
    )


def test_rollout_tools_alone_play_episodes_answered_from_the_toolbox(tools_file, tokenizer):
    episodes = scripted_tool_episodes(open_toolbox([f"{tools_file}:add"], timeout_s=5.0), tokenizer)
    rollout = episodes.generate(["what is 2 plus 3?"], policy_version=0)
    counts = {name: value.tolist() for name, value in rollout.episode.counts.items()}
    assert counts["turns"] == [2] and counts["tool_calls"] == [1] and counts["tool_failures"] == [0]
    query = tokenizer.decode(rollout.query_ids[0][rollout.query_mask[0].bool()])
    assert query.startswith("<|im_start|>system\n# Tools\n<tools>") and '"name": "add"' in query
    context = [text for text, is_action in rollout.episode.transcripts[0] if not is_action]
    assert context[0] == "\n<|im_start|>tool\n5<eos>\n<|im_start|>assistant\n"


@pytest.mark.slow
def test_lmppo_ppo_plays_episodes_with_rollout_tools_alone(run_files, tools_file, tmp_path):
    config = yaml.safe_load(run_files.read_text())
    config["rollout"] |= {"tools": [f"{tools_file}:add"], "max_turns": 2, "max_total_tokens": 40}
    run_files.write_text(yaml.safe_dump(config))
    assert run_cli("ppo", str(run_files)) == 0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert sum("episode/turns" in record for record in records) == 2


def test_a_bad_tools_spec_stops_the_run_before_any_model_loads(run_files, tools_file, capsys):
    config = yaml.safe_load(run_files.read_text())
    config["rollout"]["tools"] = [f"{tools_file}:undocumented"]
    run_files.write_text(yaml.safe_dump(config))
    assert run_cli("plan", str(run_files)) == 2  # resolve's check: no model is loaded
    err = capsys.readouterr().err
    assert "rollout.tools" in err and ":undocumented" in err and "Traceback" not in err


def test_tools_beside_an_environment_that_cannot_answer_them_are_refused_by_the_plan(
    run_files, tools_file, capsys
):
    """Before any model loads: the plan renders the prompts with the run's environment and tool schemas."""
    config = yaml.safe_load(run_files.read_text())
    config["rollout"] |= {
        "tools": [f"{tools_file}:add"],
        "environment": "lmppo.sampling.environments:SingleTurn",
    }
    run_files.write_text(yaml.safe_dump(config))
    assert run_cli("plan", str(run_files)) == 2
    err = capsys.readouterr().err
    assert "SingleTurn is not a lmppo.sampling.environments.ToolEnvironment" in err and "Traceback" not in err
