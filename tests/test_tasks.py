"""Tasks users already have: `lmppo data reasoning-gym` rows and their rewards, math-verify from threads."""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers import run_cli

from lmppo.errors import LmppoError
from lmppo.inputs.data import load_prompts, read_jsonl
from lmppo.rewards.tasks import MathVerify, ReasoningGym, math_verify_score, reasoning_gym_score

reasoning_gym = pytest.importorskip("reasoning_gym")
TASKS = sorted(set(reasoning_gym.factory.DATASETS) - {"composite"})
CHECKED = {  # tasks with no reference answer: score_answer checks an answer (a colouring, a plan) instead
    "boxnet", "graph_color", "propositional_logic", "rubiks_cube", "rush_hour",
}  # fmt: skip
LENIENT = {"game_of_life_halting"}  # its score_answer takes any non-empty answer (bool(answer))


def written(tmp_path, *args: str) -> list[dict]:
    out = tmp_path / "rows.jsonl"
    assert run_cli("data", "reasoning-gym", *args, "--out", str(out)) == 0
    return read_jsonl(out)


def reward(row: dict, text: str) -> float:
    environment = ReasoningGym()
    environment.reset(row, seed=0)
    step = environment.step(text)
    assert step.done
    return step.reward


def scoring_failures(tmp_path, tasks) -> list[str]:
    """2 rows of each task through the command; each row's own answer, in the format the prompt asks for,
    must score 1.0 and a wrong one less (a task with no reference answer: no answer scores less)."""
    failures = []
    for task in tasks:
        for row in written(tmp_path, task, "--size", "2", "--seed", "3"):
            right = reward(row, f"Thinking.\n<answer>{row['answer']}</answer>")
            wrong = reward(row, "<answer>a wrong answer</answer>")
            if task in CHECKED:
                right, wrong = 1.0 if row["answer"] is None else 0.0, reward(row, "no answer given")
            elif task in LENIENT:
                wrong = reward(row, "no answer given")
            if right != 1.0 or wrong >= 1.0:
                failures.append(f"{task}: right {right}, wrong {wrong}")
    return failures


# one of each kind: plain answers, a board compared as tuples (arc_agi), a check that raises on a word
# (prime_factorization), no reference answer (graph_color), a lenient check, a grid (sudoku); the rest: slow
FAST_TASKS = [
    "basic_arithmetic", "leg_counting", "arc_agi", "prime_factorization", "graph_color", "game_of_life_halting",
    "sudoku", "spell_backward", "propositional_logic",
]  # fmt: skip


def test_reasoning_gym_tasks_of_each_kind_make_rows_their_answers_score(tmp_path):
    assert not scoring_failures(tmp_path, FAST_TASKS)


@pytest.mark.slow
def test_every_reasoning_gym_task_makes_rows_its_answers_score(tmp_path):
    assert len(TASKS) > 100 and not scoring_failures(tmp_path, TASKS)


def test_rows_are_chat_prompts_with_the_answer_format(tmp_path):
    out = tmp_path / "rows.jsonl"
    assert (
        run_cli("data", "reasoning-gym", "basic_arithmetic", "--size", "3", "--seed", "1", "--out", str(out))
        == 0
    )
    rows, prompts = read_jsonl(out), load_prompts(out)
    assert [p[0]["role"] for p in prompts] == ["system"] * 3 and "<answer>" in prompts[0][0]["content"]
    assert [p[1]["content"] for p in prompts] == [row["entry"]["question"] for row in rows]
    assert {row["task"] for row in rows} == {"basic_arithmetic"}


def test_seeds_make_disjoint_files_and_the_same_seed_the_same_file(tmp_path):
    """reasoning-gym's seed s + 1 is seed s shifted by one entry; a file's --seed is scaled past that."""
    questions = {
        seed: [
            row["entry"]["question"]
            for row in written(tmp_path, "basic_arithmetic", "--size", "50", "--seed", seed)
        ]
        for seed in ("1", "2")
    }
    assert not set(questions["1"]) & set(questions["2"])
    again = [
        row["entry"]["question"]
        for row in written(tmp_path, "basic_arithmetic", "--size", "50", "--seed", "1")
    ]
    assert again == questions["1"]


def test_a_composite_of_tasks_with_their_settings(tmp_path):
    settings = ["--config", "leg_counting.min_animals=2", "--config", "leg_counting.max_animals=2"]
    rows = written(tmp_path, "leg_counting,basic_arithmetic", *settings, "--size", "12", "--seed", "0")
    assert {row["task"] for row in rows} == {"leg_counting", "basic_arithmetic"}
    legs = [row for row in rows if row["task"] == "leg_counting"]
    assert all(row["entry"]["metadata"]["difficulty"]["num_animals"] == [2, 2] for row in legs)
    assert all(reward(row, f"<answer>{row['answer']}</answer>") == 1.0 for row in rows)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["leg_countin"], "did you mean leg_counting"),
        (["leg_counting", "--config", "max_animal=3"], "did you mean max_animals?"),
        (["leg_counting", "--config", "max_animals"], "give key=value"),
        (["leg_counting", "--config", "seed=3"], "with --seed"),
        (["leg_counting,basic_arithmetic", "--config", "max_animals=3"], "task.key=value"),
        (["leg_counting", "--config", "max_animals=-1"], "reasoning-gym refused leg_counting"),
        (["leg_counting", "--size", "0"], "--size 0"),
    ],
)
def test_bad_inputs_are_clear_errors_and_write_nothing(tmp_path, capsys, args, says):
    out = tmp_path / "rows.jsonl"
    size = [] if "--size" in args else ["--size", "2"]
    assert run_cli("data", "reasoning-gym", *args, *size, "--seed", "0", "--out", str(out)) == 2
    assert says in capsys.readouterr().err and not out.exists()


def test_a_row_without_its_column_is_named():
    with pytest.raises(LmppoError, match="'entry' column.*lmppo data reasoning-gym"):
        ReasoningGym().reset({"prompt": "hi"}, seed=0)
    with pytest.raises(LmppoError, match="'answer' column.*answer_key"):
        MathVerify().reset({"prompt": "hi"}, seed=0)


def test_an_answer_a_task_cannot_read_scores_zero():
    """prime_factorization's check raises on a non-number: a malformed answer, not a failed run."""
    entry = {"question": "q", "answer": "2 × 3", "metadata": {"source_dataset": "prime_factorization"}}
    assert reasoning_gym_score(entry, "<answer>six</answer>") == 0.0


@pytest.mark.parametrize(("package", "call"), [("reasoning_gym", "rows"), ("math_verify", "score")])
def test_a_missing_package_names_the_extra(monkeypatch, tmp_path, package, call):
    monkeypatch.setitem(sys.modules, package, None)  # import raises ImportError
    monkeypatch.setitem(sys.modules, f"{package}.utils", None)
    with pytest.raises(LmppoError, match=r"pip install 'lmppo\[tasks\]'"):
        if call == "rows":
            from lmppo.inputs.tasks import reasoning_gym_rows

            reasoning_gym_rows("leg_counting", [], 2, 0)
        else:
            math_verify_score("42", "\\boxed{42}")


MATH_CASES = [
    ("\\frac{1}{2}", "So the result is $\\boxed{\\frac{1}{2}}$.", 1.0),  # boxed LaTeX
    ("0.5", "The answer is \\boxed{\\frac{1}{2}}", 1.0),
    ("42", "There are 42 apples.", 1.0),  # a plain number
    (42, "42", 1.0),
    ("42", "The answer is \\boxed{41}.", 0.0),  # wrong
    ("\\frac{1}{3}", "$\\boxed{0.5}$", 0.0),
]


def test_math_verify_from_eight_threads_at_once():
    """Off the main thread math-verify's SIGALRM timeouts would raise (and score 0): they are off."""
    cases = MATH_CASES * 8
    with ThreadPoolExecutor(max_workers=8) as pool:
        scores = list(pool.map(lambda case: math_verify_score(case[0], case[1]), cases))
    assert scores == [expected for _, _, expected in cases]


def test_math_verify_as_an_environment_and_a_gold_it_cannot_read():
    environment = MathVerify()
    environment.reset({"prompt": "q", "answer": "7"}, seed=0)
    step = environment.step("so \\boxed{7}")
    assert step.done and step.reward == 1.0
    with pytest.raises(LmppoError, match="cannot read the gold answer"):
        math_verify_score("", "7")
