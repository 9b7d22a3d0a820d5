"""The shipped examples keep working: their configs validate, and the SmolLM2 judge does what its README says."""

import json
import sys
from pathlib import Path

import pytest
import yaml

from lmppo.errors import UserCodeError
from lmppo.inputs.config import Config, SupervisedConfig, load_config
from lmppo.rewards.scoring import load_reward_function
from lmppo.user_code import load_function

ROOT = Path(__file__).resolve().parents[1]
JUDGE = "examples/smollm2/judge.py"


def _strings(tree):
    if isinstance(tree, dict):
        for value in tree.values():
            yield from _strings(value)
    elif isinstance(tree, str):
        yield tree


@pytest.mark.parametrize("path", sorted((ROOT / "examples").rglob("*.yaml")), ids=lambda p: p.name)
def test_example_configs_validate_and_name_files_that_ship(path):
    schema = SupervisedConfig if "model" in yaml.safe_load(path.read_text()) else Config
    cfg = load_config(path, schema=schema)  # raises on a typo or a bad value
    shipped = [v.split(":")[0] for v in _strings(cfg.model_dump()) if v.startswith("examples/")]
    assert all((ROOT / v).exists() for v in shipped), shipped  # prompts, judges: committed, not generated


@pytest.fixture
def judge(monkeypatch):
    monkeypatch.chdir(ROOT)  # the configs name the judge relative to the repository root
    return {name: load_function(f"{JUDGE}:{name}") for name in ("prompt_rows", "judge_row", "meets_target")}


def test_committed_prompt_files_are_the_judges_splits_and_share_no_question(judge):
    for split in ("train", "test"):
        rows = [json.loads(line) for line in (ROOT / f"examples/smollm2/data/prompts_{split}.jsonl").open()]
        assert rows == [{"prompt": r["prompt"], "kind": r["kind"]} for r in judge["prompt_rows"](split)]
    train, test = ({r["prompt"] for r in judge["prompt_rows"](s)} for s in ("train", "test"))
    assert len(train) >= 4 * len(test) * 0.9 and len(train) + len(test) >= 300 and not train & test


@pytest.mark.parametrize(
    "response, correct, meets",
    [
        ("Paris.", True, True),
        ("The capital of France is Paris.", True, True),
        ("The capital of France is Lyon.", False, False),
        ("Berlin or Paris.", False, False),  # a hedge: the first capital named is wrong
        ("Paris Paris Paris Paris", True, False),  # repetitive
        (
            "The capital of France, a country in Western Europe with a long history of art, food and culture, is Paris.",
            True,
            False,
        ),  # correct but not brief
        ("", False, False),
    ],
)
def test_judge_rules(judge, response, correct, meets):
    prompt = next(
        r["prompt"]
        for r in judge["prompt_rows"]("train") + judge["prompt_rows"]("test")
        if "France" in r["prompt"] and r["kind"] == "capital"
    )
    row = judge["judge_row"](prompt, response)
    assert row["correct"] == correct and judge["meets_target"](prompt, response) == float(meets)


def test_reward_ranks_short_correct_above_long_or_wrong_and_refuses_unknown_prompts(judge, monkeypatch):
    monkeypatch.chdir(ROOT)
    reward = load_reward_function(f"{JUDGE}:reward")
    prompt = "What is the opposite of hot?"
    assert prompt in {r["prompt"] for r in judge["prompt_rows"]("train") + judge["prompt_rows"]("test")}
    long = "The opposite of hot is cold, which describes a low temperature that you can feel on a winter day outside."
    scores = reward([prompt] * 3, ["Cold.", long, "Warm."]).tolist()
    assert scores[0] > scores[1] > 0 and scores[0] > scores[2]
    with pytest.raises(UserCodeError, match="raised ValueError: unknown prompt"):  # the judge refuses it
        reward(["What is love?"], ["Baby don't hurt me."])


def test_length_balanced_pairs_leave_brevity_no_signal_per_kind(monkeypatch):
    """prepare.py's length-balanced selection: per kind, chosen-shorter and chosen-longer pairs in equal
    numbers (equal lengths kept), a subset of the input in its order, the same for the same seed."""
    monkeypatch.chdir(ROOT)
    length_balanced = load_function("examples/smollm2/prepare.py:length_balanced")

    def words(n):
        return " ".join(["w"] * n)

    def sign(pair):  # -1: the chosen response is shorter, +1: longer
        gap = len(pair["chosen"].split()) - len(pair["rejected"].split())
        return (gap > 0) - (gap < 0)

    pairs = [
        {"type": kind, "chosen": words(c), "rejected": words(r), "id": i}
        for i, (kind, c, r) in enumerate(
            [("math", 2, 5)] * 6 + [("math", 5, 2)] * 2 + [("math", 3, 3)] + [("list", 4, 1)] * 3
        )
    ]
    kept = length_balanced(pairs, seed=0)
    math = [sign(p) for p in kept if p["type"] == "math"]
    assert math.count(-1) == math.count(1) == 2 and math.count(0) == 1
    assert not [p for p in kept if p["type"] == "list"]  # no chosen-shorter pair to balance them
    assert [p["id"] for p in kept] == sorted(p["id"] for p in kept)
    assert kept == length_balanced(pairs, seed=0) and kept != length_balanced(pairs, seed=3)


def test_correctness_contrast_pairs_a_correct_and_an_incorrect_answer_of_about_the_same_length(monkeypatch):
    """prepare.py's contrast pair: the correct response against the incorrect one closest to it in length,
    both judged by judge.py; none when every incorrect one is further than max_gap words away or no
    response is correct; a repetitive response is in none (repetition would decide the pair)."""
    monkeypatch.chdir(ROOT)
    contrast = load_function("examples/smollm2/prepare.py:correctness_contrast")
    judge_row = load_function(f"{JUDGE}:judge_row")
    row = {"prompt": "What city is the capital of France?", "kind": "capital"}

    def judged(*texts):
        return [(t, judge_row(row["prompt"], t)) for t in texts]

    answers = judged(
        "It is Lyon, a city in the south east.",  # incorrect, 9 words
        "Paris.",  # correct, 1 word
        "Lyon.",  # incorrect, 1 word: the closest in length to the correct one
        "The capital of France is Paris, a lovely city.",  # correct, 9 words
    )
    pair = contrast(row, answers, max_gap=4)
    assert (pair["chosen"], pair["rejected"]) == ("Paris.", "Lyon.")
    assert pair["pairing"] == "contrast" and pair["type"] == "capital"
    assert pair["chosen_reward"] > pair["rejected_reward"]
    far = judged("Paris.", "Lyon is a big city in France, not far from the Alps at all.")
    assert contrast(row, far, max_gap=4) is None and contrast(row, far, max_gap=20) is not None
    assert contrast(row, judged("Lyon.", "Marseille.", "Nice."), max_gap=4) is None
    repetitive = judged(
        "Paris is it, Paris is it, Paris is it.", "Lyon is it, Lyon is it, Lyon is it.", "Lyon."
    )
    assert contrast(row, repetitive, max_gap=10) is None


def test_answered_at_least_once_counts_prompts_not_samples(monkeypatch):
    """prepare.py's knowledge measure: a prompt counts once if any of its k side-by-side samples is correct."""
    monkeypatch.chdir(ROOT)
    answered = load_function("examples/smollm2/prepare.py:answered_at_least_once")
    verdicts = [{"correct": c} for c in (False, True, False, False, True, True)]
    assert answered(verdicts, 2) == pytest.approx(2 / 3)  # (F, T) (F, F) (T, T)
    assert answered(verdicts, 3) == 1.0 and answered(verdicts, 1) == 0.5


def test_answered_by_majority_needs_correct_to_outnumber_each_wrong_answer(monkeypatch):
    """prepare.py's sharpening measure: accepted forms pool, wrong answers count one by one, no answer is left out."""
    monkeypatch.chdir(ROOT)
    majority = load_function("examples/smollm2/prepare.py:answered_by_majority")

    def v(found, correct=False):
        return {"found": found, "correct": correct}

    sure = [v("Paris", True), v("paris", True), v("Lyon"), v(None)]
    split = [v("Paris", True), v("Lyon"), v("lyon"), v("Nice")]  # one correct, the wrong ones agree
    scattered = [v("Paris", True), v("paris", True), v("Lyon"), v("Nice")]  # 2 of 4, more than each wrong
    tie = [v("Paris", True), v("Lyon"), v(None), v(None)]
    assert majority(sure + split, 4) == 0.5
    assert majority(scattered, 4) == 1.0 and majority(tie, 4) == 0.0


CALCULATOR = "examples/smollm2_calculator/calculator.py"


@pytest.fixture
def calculator(monkeypatch):
    monkeypatch.chdir(ROOT)
    return sys.modules[load_function(f"{CALCULATOR}:Calculator").__module__]


def test_calculator_data_files_are_the_modules_and_replay_through_its_environment(calculator):
    datasets = calculator.datasets()
    for name, rows in datasets.items():
        committed = [
            json.loads(line) for line in (ROOT / f"examples/smollm2_calculator/data/{name}.jsonl").open()
        ]
        assert committed == rows, name
    train = {r["prompt"][-1]["content"] for r in datasets["prompts_train"]}
    test = {r["prompt"][-1]["content"] for r in datasets["prompts_test"]}
    assert len(test) == 150 and not train & test
    right = 0
    for row in datasets["sft_train"]:  # every tool message is what the environment answers to the call
        env, messages = calculator.Calculator(), row["messages"]
        env.reset(row, seed=0)
        for turn, answer in zip(messages[2::2], messages[3::2]):
            assert env.step(turn["content"]).messages == [answer]
        assert env.step(messages[-1]["content"]).done
        right += calculator.correct(messages[:2], messages[-1]["content"])
    assert 0.7 < right / len(datasets["sft_train"]) < 0.85  # the annotator slips on about a quarter


def test_calculator_tool_refuses_what_is_not_arithmetic_and_a_failed_call_costs(calculator):
    assert calculator.calculator("12 * (3 + 4)") == "84" and calculator.calculator("7 / 2") == "3.5"
    env = calculator.Calculator()
    env.reset({}, seed=0)
    bad = '<tool_call>{"name": "calculator", "arguments": {"expression": "__import__(\'os\')"}}</tool_call>'
    step = env.step(bad)
    assert step.tool_failures == 1 and step.reward == -0.2 and "error" in step.messages[0]["content"]
    problem = calculator.problems("test", 1, stream="prompts")[0]
    answer = f"The answer is {problem.answer}."
    assert calculator.reward([problem.prompt] * 3, [answer, "The answer is 1.", bad]) == [1.0, 0.0, 0.0]
