"""Prompt and demonstration loading, and the resumable prompt stream."""

import json

import pytest

from lmppo.data import PromptStream, load_demonstrations, load_prompts
from lmppo.errors import LmppoError


def write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_prompts_from_jsonl_strings_and_messages(tmp_path):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    path = write_jsonl(
        tmp_path / "p.jsonl", [{"prompt": "hello"}, {"messages": messages}, {"prompt": messages}]
    )
    assert load_prompts(path) == ["hello", messages, messages]


@pytest.mark.parametrize(
    "row", [{"text": "x"}, {"prompt": ""}, {"messages": []}, {"messages": [{"role": "user"}]}]
)
def test_row_without_prompt_names_the_row(tmp_path, row):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "ok"}, row])
    with pytest.raises(LmppoError, match=r"p\.jsonl, row 2 has no prompt"):
        load_prompts(path)


def test_bad_json_line_and_missing_file(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n{not json}\n')
    with pytest.raises(LmppoError, match="line 2: not valid JSON"):
        load_prompts(path)
    with pytest.raises(LmppoError, match="does not exist"):
        load_prompts(tmp_path / "missing.jsonl")


def test_prompts_from_a_datasets_directory(tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.DatasetDict({"train": datasets.Dataset.from_list([{"prompt": "a"}, {"prompt": "b"}])})
    ds.save_to_disk(str(tmp_path / "ds"))
    assert load_prompts(tmp_path / "ds", split="train") == ["a", "b"]
    with pytest.raises(LmppoError, match="data.split"):
        load_prompts(tmp_path / "ds")


def test_demonstrations_need_a_response(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "q", "response": "a"}, {"prompt": "q"}])
    with pytest.raises(LmppoError, match="row 2 has no 'response'"):
        load_demonstrations(path)


def test_prompt_stream_resumes_exactly_and_shards_ranks():
    prompts = [f"p{i}" for i in range(10)]
    full = PromptStream(prompts, 4, shuffle=True, seed=3)
    batches = [full.next_batch() for _ in range(7)]  # crosses epochs (10 // 4 = 2 batches per epoch)
    assert batches[0] != batches[2] and sorted(batches[0] + batches[1]) != sorted(prompts[:8])  # shuffled
    resumed = PromptStream(prompts, 4, shuffle=True, seed=3)
    for _ in range(3):
        resumed.next_batch()
    state = resumed.state_dict()
    again = PromptStream(prompts, 4, shuffle=True, seed=3)
    again.load_state_dict(state)
    assert [again.next_batch() for _ in range(4)] == batches[3:]
    ranks = [PromptStream(prompts, 4, shuffle=True, seed=3, rank=r, world_size=2) for r in range(2)]
    assert [ranks[0].next_batch() + ranks[1].next_batch() for _ in range(3)] == batches[:3]
    with pytest.raises(LmppoError, match="divisible"):
        PromptStream(prompts, 3, shuffle=False, seed=0, world_size=2)
