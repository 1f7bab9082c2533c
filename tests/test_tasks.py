"""Tasks and rewards: golden grader cases, the safe Countdown evaluator, generators, the char
tokenizer, data loading, the task registry, the reward worker pool, and pass@k."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from tbajax.tasks import (
    DatasetUnavailableError,
    Problem,
    RewardPool,
    Task,
    TaskRegistry,
    accuracy,
    default_evaluator,
    get_task,
    mean_pass_at_k,
    pass_at_k,
)
from tbajax.tasks import arithmetic, countdown, gsm8k, hendrycks_math
from tbajax.tasks.data import split_of
from tbajax.trajectory import RewardStatus

OK, WRONG, NO_ANSWER, TIMEOUT, ERROR = (
    RewardStatus.OK,
    RewardStatus.WRONG,
    RewardStatus.NO_ANSWER,
    RewardStatus.TIMEOUT,
    RewardStatus.ERROR,
)


# --- reward functions for the pool tests (module level so workers can unpickle them) ----------


def exact_match(completion, answer):
    return (1.0, OK) if completion == answer else (0.0, WRONG)


def sleeps_forever(completion, answer):
    while True:
        time.sleep(1.0)


def raises(completion, answer):
    raise ValueError(f"grader exploded on {completion!r}")


def exits_process(completion, answer):
    if completion == "crash":
        os._exit(7)
    return exact_match(completion, answer)


def crashes_on_first_try(completion, answer):
    """Kills its worker unless the file `answer` exists, which it makes first: a one-off death."""
    marker = Path(answer)
    if not marker.exists():
        marker.write_text("died once")
        os._exit(3)
    return exact_match(completion, completion)


def mixed_behaviour(completion, answer):
    if completion == "hang":
        sleeps_forever(completion, answer)
    if completion == "crash":
        os._exit(1)
    if completion == "raise":
        raises(completion, answer)
    return exact_match(completion, answer)


def returns_garbage(completion, answer):
    return "not a reward"


def _task(fn, cheap=False) -> Task:
    return Task(name="test", load_fn=lambda split: [], prompt_fn=lambda p: p.question, reward_fn=fn, cheap_reward=cheap)


# --- arithmetic ----------------------------------------------------------------------------------


def test_arithmetic_problems_are_correct_deterministic_and_splits_disjoint():
    task = get_task("arithmetic", digits=2, operators=("+", "-", "*"), seed=3, num_eval=200)
    train, ev = task.load("train"), task.load("eval")
    again = get_task("arithmetic", digits=2, operators=("+", "-", "*"), seed=3, num_eval=200)
    assert [p.question for p in ev] == [p.question for p in again.load("eval")]
    assert [train[i].question for i in range(50)] == [again.load("train")[i].question for i in range(50)]
    other_seed = get_task("arithmetic", digits=2, operators=("+", "-", "*"), seed=4, num_eval=200)
    assert [p.question for p in ev] != [p.question for p in other_seed.load("eval")]

    assert len(ev) == 200 and len({p.question for p in ev}) == 200  # eval has no duplicates
    train_qs = {train[i].question for i in range(5000)}
    assert not train_qs & {p.question for p in ev}  # disjoint by construction
    ops = set()
    for p in [*ev, *(train[i] for i in range(200))]:
        a, op, b = p.meta["a"], p.meta["op"], p.meta["b"]
        ops.add(op)
        assert 10 <= a <= 99 and 10 <= b <= 99
        assert p.question == f"{a}{op}{b}="
        assert int(p.answer) == {"+": a + b, "-": a - b, "*": a * b}[op]
        assert op != "-" or int(p.answer) >= 0  # nonnegative by default
    assert ops == {"+", "-", "*"}
    assert [p.id for p in ev] == list(range(200))
    assert task.prompt(ev[0]) == ev[0].question


def test_arithmetic_config_errors():
    with pytest.raises(ValueError, match="operators"):
        get_task("arithmetic", operators=("^",))
    with pytest.raises(ValueError, match="too many distinct problems"):
        get_task("arithmetic", digits=1, num_eval=500)
    with pytest.raises(ValueError, match="unknown split"):
        get_task("arithmetic").load("test")


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        ("579", "579", (1.0, OK)),
        (" 5 7 9 ", "579", (1.0, OK)),
        ("578", "579", (0.0, WRONG)),
        ("5790", "579", (0.0, WRONG)),
        ("579=", "579", (0.0, WRONG)),
        ("", "579", (0.0, NO_ANSWER)),
        ("   ", "579", (0.0, NO_ANSWER)),
        ("-33", "-33", (1.0, OK)),
    ],
)
def test_arithmetic_reward(completion, answer, expected):
    assert arithmetic.arithmetic_reward(completion, answer) == expected


def test_char_tokenizer_round_trip(tmp_path):
    from transformers import AutoTokenizer

    built = arithmetic.build_char_tokenizer(tmp_path / "tok")
    tok = AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert len(tok) == len(arithmetic.CHAR_VOCAB)
    ids = tok("123+456=")["input_ids"]
    vocab = {c: i for i, c in enumerate(arithmetic.CHAR_VOCAB)}
    assert ids == [1] + [vocab[c] for c in "123+456="]
    assert ids == built("123+456=")["input_ids"]
    assert tok.decode(ids, skip_special_tokens=True) == "123+456="
    assert tok.decode([vocab["5"], vocab["7"], vocab["9"], 2, 0], skip_special_tokens=True) == "579"
    assert tok.decode([vocab[c] for c in "1 - 2"]) == "1 - 2"
    batch = tok(["1+2=", "10+20="], padding=True)["input_ids"]
    assert batch[0][:2] == [0, 0] and batch[0][2] == 1  # left padding for decoding


def test_chat_prompt_uses_the_tokenizer_template():
    tok = arithmetic.build_char_tokenizer()
    task = get_task("gsm8k", chat=True, system_prompt="Be brief.")
    problem = Problem(id=0, question="What is 2+2?", answer="4")
    with pytest.raises(ValueError, match="no chat template"):
        task.prompt(problem, tok)
    tok.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    assert task.prompt(problem, tok) == "<system>Be brief.<user>What is 2+2?<assistant>"
    assert get_task("gsm8k").prompt(problem) == "[MATH TASK] Problem:\nWhat is 2+2?\n\nSolution:\n"


def test_few_shot_demos_are_earlier_turns_or_blocks():
    tok = arithmetic.build_char_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    demo = Problem(id=-1, question="What is 1+1?", answer="2")
    problem = Problem(id=0, question="What is 2+2?", answer="4")
    chat = dataclasses.replace(get_task("gsm8k", chat=True, system_prompt="Be brief."), few_shot=((demo, "2"),))
    assert chat.prompt(problem, tok) == (
        "<system>Be brief.<user>What is 1+1?<assistant>2<user>What is 2+2?<assistant>"
    )
    plain = dataclasses.replace(get_task("gsm8k"), few_shot=((demo, "It is 2."),))
    assert plain.prompt(problem) == (
        "[MATH TASK] Problem:\nWhat is 1+1?\n\nSolution:\nIt is 2.\n\n"
        "[MATH TASK] Problem:\nWhat is 2+2?\n\nSolution:\n"
    )


# --- GSM8K -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        ("So she pays 5 + 13 = 18 dollars.\nThe answer is 18", "18", (1.0, OK)),
        ("The total is 1,234,567 apples", "1234567", (1.0, OK)),
        ("It costs $1,000.", "1000", (1.0, OK)),
        ("It costs $1,000.50 in total", "2001/2", (1.0, OK)),
        ("He gets 3.50 back", "7/2", (1.0, OK)),  # 3.50 == 3.5
        ("He gets 3.5 back", "7/2", (1.0, OK)),
        ("It is 3.51", "7/2", (0.0, WRONG)),
        ("The change is -5 degrees", "-5", (1.0, OK)),
        ("He loses -$5", "-5", (1.0, OK)),
        ("10-3=7", "7", (1.0, OK)),  # binary minus, not -3 or -7
        ("the difference is 10 - 3", "3", (1.0, OK)),
        ("x = 1.5e3", "1500", (1.0, OK)),
        ("rate 2e-3", "1/500", (1.0, OK)),
        ("first 72 then 73", "72", (0.0, WRONG)),  # the LAST number counts
        ("the numbers 3,4,5", "5", (1.0, OK)),  # commas not in thousands groups separate numbers
        ("about .5 of it", "1/2", (1.0, OK)),
        ("I don't know.", "18", (0.0, NO_ANSWER)),
        ("", "18", (0.0, NO_ANSWER)),
        ("9" * 5000, "9", (0.0, WRONG)),  # too long to convert: wrong, not a crash
    ],
)
def test_gsm8k_last_number_grader(completion, answer, expected):
    assert gsm8k.last_number_reward(completion, answer) == expected


def test_gsm8k_strict_and_answer_is_graders():
    assert gsm8k.strict_reward("work... #### 1,234", "1234") == (1.0, OK)
    assert gsm8k.strict_reward("#### 5 then #### 6", "6") == (1.0, OK)
    assert gsm8k.strict_reward("the answer is 6", "6") == (0.0, NO_ANSWER)
    assert gsm8k.strict_reward("#### -3", "-3") == (1.0, OK)
    assert gsm8k.answer_is_reward("The answer is: $18.", "18") == (1.0, OK)
    assert gsm8k.answer_is_reward("so THE ANSWER IS 3.50 and more text 9", "7/2") == (1.0, OK)
    assert gsm8k.answer_is_reward("the final answer is \\boxed{42}", "42") == (1.0, OK)
    assert gsm8k.answer_is_reward("the answer is 17", "18") == (0.0, WRONG)
    assert gsm8k.answer_is_reward("18", "18") == (0.0, NO_ANSWER)
    assert gsm8k.gold_number("Natalia sold 48/2 = 24 clips.\n#### 72") == "72"
    assert gsm8k.gold_number("#### 1,000") == "1000"
    assert gsm8k.gold_number("no marker, last is 3.50") == "7/2"
    with pytest.raises(ValueError, match="no number"):
        gsm8k.gold_number("none")
    with pytest.raises(ValueError, match="unknown GSM8K grader"):
        get_task("gsm8k", grader="fuzzy")
    assert get_task("gsm8k", grader="strict").reward_fn is gsm8k.strict_reward


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_gsm8k_local_data(tmp_path):
    rows = [{"question": "Q1?", "answer": "a\n#### 4"}, {"question": "Q2?", "answer": "b\n#### 1,500"}]
    _write_jsonl(tmp_path / "gsm" / "main" / "train.jsonl", rows)
    _write_jsonl(tmp_path / "gsm" / "main" / "test.jsonl", rows[:1])
    task = get_task("gsm8k", data_path=str(tmp_path / "gsm"))
    train = task.load("train")
    assert [(p.id, p.question, p.answer) for p in train] == [(0, "Q1?", "4"), (1, "Q2?", "1500")]
    assert len(task.load("eval")) == 1
    assert task.reward("so 1500", train[1].answer) == (1.0, OK)
    # a '{split}' pattern, and explicit per-split files
    _write_jsonl(tmp_path / "flat" / "gsm_test.jsonl", rows)
    assert len(get_task("gsm8k", data_path=str(tmp_path / "flat" / "gsm_{split}.jsonl")).load("eval")) == 2
    assert len(get_task("gsm8k", eval_path=str(tmp_path / "flat" / "gsm_test.jsonl")).load("eval")) == 2
    # wrong field names say what the rows have
    _write_jsonl(tmp_path / "bad" / "train.jsonl", [{"q": "x", "a": "1"}])
    with pytest.raises(ValueError, match="lacks field"):
        get_task("gsm8k", data_path=str(tmp_path / "bad")).load("train")
    with pytest.raises(DatasetUnavailableError, match="no eval data under data_path"):
        get_task("gsm8k", data_path=str(tmp_path / "bad")).load("eval")


def test_missing_dataset_fails_fast_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    t0 = time.monotonic()
    with pytest.raises(DatasetUnavailableError) as info:
        get_task("gsm8k").load("train")
    assert time.monotonic() - t0 < 2.0
    msg = str(info.value)
    assert "--set task.data_path=" in msg and "openai/gsm8k" in msg
    with pytest.raises(DatasetUnavailableError, match="--set task.data_path="):
        get_task("math", string_fallback=True).load("eval")


# --- MATH -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so \\boxed{42}.", "42"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("first \\boxed{1}, finally \\boxed{2}", "2"),
        ("\\fbox{7}", "7"),
        ("\\boxed{\\{1,2\\}}", "\\{1,2\\}"),  # escaped braces do not close the box
        ("\\boxed{x^{2}+\\sqrt{y_{1}}}", "x^{2}+\\sqrt{y_{1}}"),
        ("\\boxed 5 apples", "5"),
        ("\\boxed{1} then \\boxed{2", None),  # the last box is unbalanced
        ("\\boxed{}", None),
        ("\\boxed{ }", None),
        ("no box here: 42", None),
        ("\\boxedtext{3}", None),
    ],
)
def test_last_boxed(text, expected):
    assert hendrycks_math.last_boxed(text) == expected


def test_math_reward_with_math_verify():
    pytest.importorskip("math_verify")
    r = hendrycks_math.math_reward
    assert r("Thus \\boxed{\\frac{1}{2}}", "0.5") == (1.0, OK)
    assert r("\\boxed{\\dfrac{1}{2}}", "\\frac12") == (1.0, OK)
    assert r("\\boxed{(1,2)}", "(1, 2)") == (1.0, OK)
    assert r("\\boxed{\\text{Monday}}", "\\text{Monday}") == (1.0, OK)
    assert r("\\boxed{2}", "3") == (0.0, WRONG)
    assert r("the answer is 3", "3") == (0.0, NO_ANSWER)


def test_math_string_fallback_only_when_opted_in(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # import math_verify now fails
    with pytest.raises(ImportError, match="string_fallback"):
        hendrycks_math.math_reward("\\boxed{3}", "3")
    with pytest.raises(ImportError, match="math-verify"):
        get_task("math")
    task = get_task("math", string_fallback=True)
    assert task.reward("\\boxed{\\dfrac{1}{2}}", "\\frac{1}{2}") == (1.0, OK)
    assert task.reward("\\boxed{ 10^\\circ }", "10") == (1.0, OK)
    assert task.reward("\\boxed{0.5}", "\\frac{1}{2}") == (0.0, WRONG)  # no equivalence without math-verify
    assert task.cheap_reward is False


def test_math_local_data(tmp_path):
    _write_jsonl(tmp_path / "test.jsonl", [{"problem": "1+1?", "answer": "2", "level": 1}])
    _write_jsonl(tmp_path / "train.jsonl", [{"problem": "2+2?", "solution": "It is $\\boxed{4}$."}])
    task = get_task("math", data_path=str(tmp_path), string_fallback=True)
    (ev,), (tr,) = task.load("eval"), task.load("train")
    assert (ev.answer, ev.meta["level"], tr.answer) == ("2", 1, "4")
    assert task.prompt(ev).startswith("1+1?\n") and "\\boxed{}" in task.prompt(ev)


# --- Countdown --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "expr",
    [
        "99**87**45",
        "2**3",
        "x + 1",
        "abs(3)",
        "(1).real",
        "__import__('os')",
        "1 if 1 else 2",
        "[1][0]",
        "1 < 2",
        "lambda: 1",
        "3.5 * 2",
        "-3 + 5",  # unary minus is not a Countdown operation
        "+3",
        "1_000",
        "0x10",
        "7 // 2",
        "7 % 2",
        "1e3",
        "10000000 + 1",  # literal above the bound
        "(1 + " * 20 + "1" + ")" * 20,  # operators nested too deep
        "+".join(["1"] * 100),  # too many nodes
        "1" * 300,  # too long
        "",
        "1 +",
        "1;2",
    ],
)
def test_safe_eval_rejects(expr):
    t0 = time.monotonic()
    with pytest.raises(countdown.ExpressionError):
        countdown.safe_eval(expr)
    assert time.monotonic() - t0 < 0.1


def test_safe_eval_exact_rationals():
    assert countdown.safe_eval("(6/4)*4") == 6
    assert countdown.safe_eval("1/3 + 1/3 + 1/3") == 1
    assert countdown.safe_eval("(10 - 4) / 4") == Fraction(3, 2)
    assert countdown.safe_eval(" 2 * (3 + 4) - 5 ") == 9
    with pytest.raises(ZeroDivisionError):
        countdown.safe_eval("1 / (2 - 2)")
    assert countdown.literals(countdown.parse_expression("(6/4)*4")) == [6, 4, 4]


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("<think>...</think><answer> (6 / 4) * 4 * 1 </answer>", (1.0, OK)),  # exact rationals
        ("<answer>1 * 4 * 6 / 4</answer>", (1.0, OK)),
        ("<answer>4 * 6 / 4 + 1</answer>", (0.1, WRONG)),  # right numbers, wrong value
        ("<answer>6</answer>", (0.1, WRONG)),  # right value, numbers missing
        ("<answer>6 * 4 / 4 * 1 * 1</answer>", (0.1, WRONG)),  # 1 used twice
        ("<answer>6 * 4 / 4 * 1 + 0</answer>", (0.1, WRONG)),  # a number that was not given
        ("<answer>6 / (4 - 4) * 1</answer>", (0.1, WRONG)),  # division by zero
        ("<answer>wrong</answer> then <answer>4*6/4*1</answer>", (1.0, OK)),  # the last answer counts
        ("<answer>4*6/4*1</answer> then <answer>6</answer>", (0.1, WRONG)),
        ("<answer>6**1 * 4 / 4</answer>", (0.0, NO_ANSWER)),  # pow: malformed
        ("<answer>99**87**45</answer>", (0.0, NO_ANSWER)),
        ("<answer>(6 / 4) * 4 * 1 = 6</answer>", (0.0, NO_ANSWER)),
        ("<answer></answer>", (0.0, NO_ANSWER)),
        ("(6 / 4) * 4 * 1", (0.0, NO_ANSWER)),  # no tags
    ],
)
def test_countdown_reward(completion, expected):
    answer = countdown.CountdownAnswer(target=6, numbers=(6, 4, 4, 1))
    assert countdown.countdown_reward(completion, answer) == expected


def test_countdown_generator_solvable_deterministic_disjoint():
    task = get_task("countdown", seed=1, num_eval=100)
    ev, train = task.load("eval"), task.load("train")
    assert [p.answer for p in ev] == [p.answer for p in get_task("countdown", seed=1, num_eval=100).load("eval")]
    for p in [*ev, *(train[i] for i in range(100))]:
        a = p.answer
        assert 3 <= len(a.numbers) <= 4 and all(1 <= x <= 99 for x in a.numbers) and 1 <= a.target <= 100
        witness = f"<answer>{p.meta['solution']}</answer>"
        assert countdown.countdown_reward(witness, a) == (1.0, OK)  # solvable by construction
    key = lambda p: (tuple(sorted(p.answer.numbers)), p.answer.target)  # noqa: E731
    assert not {key(p) for p in ev} & {key(train[i]) for i in range(2000)}
    prompt = task.prompt(ev[0])
    assert str(list(ev[0].answer.numbers)) in prompt and f"equals {ev[0].answer.target}" in prompt
    assert "<answer>" in prompt and prompt.endswith("<think>")
    assert get_task("countdown", chat=True).prompt_fn(ev[0]) == countdown.instruction(ev[0])


def test_countdown_prompt_template_and_demos_from_the_train_side():
    template = "Make {target} from {numbers}."
    task = get_task("countdown", seed=3, num_numbers=(2, 2), max_number=10, target_range=(1, 30),
                    num_eval=300, prompt_template=template, few_shot=3)
    ev = task.load("eval")
    assert task.prompt_fn(ev[0]) == f"Make {ev[0].answer.target} from {list(ev[0].answer.numbers)}."
    assert len(task.few_shot) == 3
    key = lambda a: (tuple(sorted(a.numbers)), a.target)  # noqa: E731
    eval_keys = {key(p.answer) for p in ev}
    for demo, reply in task.few_shot:
        assert countdown.countdown_reward(reply, demo.answer) == (1.0, OK)  # a solved example
        assert key(demo.answer) not in eval_keys  # never an eval puzzle
    assert task.few_shot == get_task("countdown", seed=3, num_numbers=(2, 2), max_number=10,
                                     target_range=(1, 30), prompt_template=template, few_shot=3).few_shot
    with pytest.raises(ValueError, match="only fields are {numbers} and {target}"):
        get_task("countdown", prompt_template="Make {goal}.")
    with pytest.raises(ValueError, match="few_shot must be >= 0"):
        get_task("countdown", few_shot=-1)


def test_split_of_is_stable_and_proportional():
    assert split_of("123+456", 0, 0.1) == split_of("123+456", 0, 0.1)
    share = sum(split_of(str(i), 0, 0.25) == "eval" for i in range(4000)) / 4000
    assert 0.22 < share < 0.28
    with pytest.raises(ValueError):
        split_of("x", 0, 1.0)


# --- registry ---------------------------------------------------------------------------------------


def _user_task(scale: float = 1.0) -> Task:
    return Task(
        name="user",
        load_fn=lambda split: [Problem(0, "hi", "hi")],
        prompt_fn=lambda p: p.question,
        reward_fn=exact_match,
        success_threshold=scale,
    )


def test_registry():
    reg = TaskRegistry()
    reg.register("mine", _user_task)
    assert reg.get("mine", scale=0.5).success_threshold == 0.5
    with pytest.raises(ValueError, match="already registered"):
        reg.register("mine", _user_task)
    with pytest.raises(TypeError, match="does not accept"):
        reg.get("mine", digits=3)
    with pytest.raises(KeyError, match="unknown task 'nope'"):
        reg.get("nope")
    assert reg.get(f"{__name__}:_user_task").name == "user"  # a 'module:factory' path
    t = _user_task()
    assert reg.get(t) is t and reg.get(t, chat=True).chat
    assert get_task("tbajax.tasks.arithmetic:arithmetic_task", digits=2, num_eval=5).load("eval")[0].meta["a"] < 100
    with pytest.raises(ValueError, match="cannot import task .no_such_module_xyz:make"):
        get_task("no_such_module_xyz:make")


def test_registry_import_is_light():
    code = (
        "import sys, tbajax.tasks, tbajax.tasks.arithmetic, tbajax.tasks.gsm8k, tbajax.tasks.countdown, "
        "tbajax.tasks.hendrycks_math, tbajax.tasks.reward_pool\n"
        "tbajax.tasks.get_task('arithmetic'); tbajax.tasks.get_task('countdown')\n"
        "heavy = [m for m in ('math_verify', 'reasoning_gym', 'datasets', 'transformers', 'tokenizers', 'jax', 'sympy') "
        "if m in sys.modules]\n"
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parent.parent)


# --- reward pool -------------------------------------------------------------------------------------


def test_reward_pool_timeout_error_crash_and_recovery():
    with RewardPool(num_workers=2, timeout_s=1.0) as pool:
        assert pool.score(_task(exact_match), [("1", "1"), ("2", Problem(0, "q", "3"))]) == [(1.0, OK), (0.0, WRONG)]

        t0 = time.monotonic()
        assert pool.score(_task(sleeps_forever), [("x", "y")]) == [(0.0, TIMEOUT)]
        assert time.monotonic() - t0 < 2.0  # killed within ~timeout + 1 s

        detailed = pool.score_detailed(_task(raises), [("x", "y")])
        assert detailed[0][:2] == (0.0, ERROR) and "grader exploded on 'x'" in detailed[0].error

        assert pool.score(_task(exits_process), [("crash", "y"), ("y", "y")]) == [(0.0, ERROR), (1.0, OK)]
        assert pool.score(_task(exits_process), [("y", "y")]) == [(1.0, OK)]  # the pool still works

        items = [(c, "ok") for c in ("ok", "hang", "crash", "raise", "no", "ok")]
        t0 = time.monotonic()
        got = pool.score(_task(mixed_behaviour), items)
        assert got == [(1.0, OK), (0.0, TIMEOUT), (0.0, ERROR), (0.0, ERROR), (0.0, WRONG), (1.0, OK)]
        assert time.monotonic() - t0 < 4.0
        assert pool.score(_task(returns_garbage), [("a", "b")]) == [(0.0, ERROR)]
        assert pool.restarts >= 3
    with pytest.raises(RuntimeError, match="closed"):
        pool.run(exact_match, [("a", "a")])


def test_reward_pool_scores_again_a_sample_whose_worker_died_once(tmp_path):
    """A worker that dies while scoring (a crash, or CPython's forkserver losing its status: exit
    code 255 under load) costs its sample a second try on a fresh worker, not an ERROR; a sample
    that kills that one too gets ERROR, with the exit code."""
    with RewardPool(num_workers=1, timeout_s=5.0) as pool:
        marker = tmp_path / "marker"
        assert pool.score(_task(crashes_on_first_try), [("a", str(marker)), ("b", str(marker))]) == [(1.0, OK)] * 2
        assert marker.exists() and pool.restarts == 1
        (r,) = pool.score_detailed(_task(exits_process), [("crash", "y")])
        assert r[:2] == (0.0, ERROR) and "exit code 7" in r.error and "2 times" in r.error
        assert pool.restarts == 3


USER_TASK_FILE = """
import dataclasses
from tbajax.tasks import Problem, Task
from tbajax.trajectory import RewardStatus


@dataclasses.dataclass(frozen=True)
class Gold:
    text: str


def reward(completion, answer):
    return (1.0, RewardStatus.OK) if completion == answer.text else (0.0, RewardStatus.WRONG)


def make_task(word="yes"):
    problems = [Problem(0, "say " + word, Gold(word))]
    return Task(name="say", load_fn=lambda split: problems, prompt_fn=lambda p: p.question, reward_fn=reward)
"""


def test_user_task_file_scored_in_workers(tmp_path):
    path = tmp_path / "my_tasks.py"
    path.write_text(USER_TASK_FILE)
    task = get_task(f"{path}:make_task", word="hello")
    (problem,) = task.load("train")
    assert task.prompt(problem) == "say hello"
    with RewardPool(num_workers=1, timeout_s=5.0) as pool:
        # the reward function and the answer's class live in a file that is not importable by name
        assert pool.score(task, [("hello", problem), ("bye", problem)]) == [(1.0, OK), (0.0, WRONG)]
        unpicklable = dataclasses.replace(task, reward_fn=lambda c, a: (1.0, OK))
        (r,) = pool.score_detailed(unpicklable, [("hello", problem)])
        assert r[:2] == (0.0, ERROR) and "cannot send" in r.error
        assert pool._workers[0].process.is_alive()


def test_reward_pool_cheap_path_runs_in_process_and_catches():
    with RewardPool(num_workers=1, timeout_s=1.0) as pool:
        got = pool.score(_task(raises, cheap=True), [("x", "y")])
        assert got == [(0.0, ERROR)]
        assert pool._workers == []  # no worker was started for a cheap task
        task = get_task("arithmetic")
        assert pool.score(task, [("579", Problem(0, "123+456=", "579")), ("", Problem(0, "", "1"))]) == [
            (1.0, OK),
            (0.0, NO_ANSWER),
        ]


def test_reward_pool_runs_math_verify_in_workers():
    pytest.importorskip("math_verify")
    task = get_task("math")
    with RewardPool(num_workers=1, timeout_s=20.0) as pool:
        got = pool.score(task, [("\\boxed{\\frac{2}{4}}", "0.5"), ("\\boxed{3}", "4"), ("none", "1")])
    assert got == [(1.0, OK), (0.0, WRONG), (0.0, NO_ANSWER)]


# --- evaluation --------------------------------------------------------------------------------------


def test_pass_at_k_hand_computed():
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    assert pass_at_k(5, 2, 3) == pytest.approx(1 - 1 / 10)  # 1 - C(3,3)/C(5,3)
    assert pass_at_k(5, 2, 4) == 1.0  # fewer than k wrong samples
    assert pass_at_k(5, 0, 3) == 0.0
    assert pass_at_k(10, 10, 1) == 1.0
    assert pass_at_k(200, 1, 100) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        pass_at_k(5, 6, 1)
    with pytest.raises(ValueError):
        pass_at_k(5, 1, 6)
    assert accuracy([1.0, 0.0, 1.0, 0.1]) == 0.5
    assert accuracy([1.0, 0.1], success_threshold=0.1) == 1.0
    assert mean_pass_at_k([[1, 0], [0, 0, 0, 1]], 2) == pytest.approx((1.0 + 0.5) / 2)
    m = default_evaluator([[1.0, 0.0], [0.0, 0.0]], 1.0)
    assert m == {"accuracy": 0.5, "mean_reward": 0.25, "pass@1": 0.25, "pass@2": 0.5}
    assert get_task("countdown").evaluate([[1.0], [0.1]]) == {"accuracy": 0.5, "mean_reward": pytest.approx(0.55)}


# --- graders that cannot stall a run (issue 19) ----------------------------------------------------


def _timed(fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0


@pytest.mark.parametrize("completion", [
    "the answer is" + " " * 2000,  # four backtracking \s* made this O(n^4): 200 spaces took 22 s
    "The final answer is:" + " " * 2000 + "$" + " " * 2000,
    "the answer is " * 3000,
    "#### " + " " * 5000,
])
def test_gsm8k_graders_are_linear_on_adversarial_whitespace(completion):
    for grader in gsm8k.GRADERS.values():
        (reward, status), seconds = _timed(grader, completion, "7")
        assert (reward, status) == (0.0, NO_ANSWER) or grader is gsm8k.last_number_reward
        assert seconds < 1.0, f"{grader.__name__} took {seconds:.2f}s"
    # the same patterns still find the number after any amount of whitespace
    assert gsm8k.answer_is_reward("the answer is" + " " * 500 + "7", "7") == (1.0, OK)
    assert gsm8k.answer_is_reward("The final answer is: $ \\boxed{ 7}", "7") == (1.0, OK)
    assert gsm8k.strict_reward("####" + " " * 500 + "7", "7") == (1.0, OK)


@pytest.mark.parametrize("completion", [
    "<answer>" * 8000,  # the non-greedy regex scanned to the end from every tag: 7.8 s
    "<answer>" * 50_000 + "1 + 2</answer>",
    "</answer>" * 50_000,
])
def test_countdown_answer_extraction_is_linear(completion):
    got, seconds = _timed(countdown.countdown_reward, completion, countdown.CountdownAnswer(3, (1, 2)))
    assert seconds < 1.0, f"took {seconds:.2f}s"
    assert got == (0.0, NO_ANSWER)


@pytest.mark.parametrize("completion, expected", [
    ("<answer>a</answer> <answer> b </answer>", "b"),
    ("<answer>a</answer></answer>", "a"),  # a stray closing tag closes nothing
    ("<answer><answer>x</answer>", "<answer>x"),  # the first opening tag pairs with the close
    ("<answer>a</answer><answer>unclosed", "a"),
    ("<answer>\n1 +\n2\n</answer>", "1 +\n2"),
    ("no tags", None),
])
def test_countdown_extract_answer_pairs_like_the_non_greedy_regex(completion, expected):
    assert countdown.extract_answer(completion) == expected


def test_expensive_task_graded_in_process_is_refused_with_the_fix():
    from tbajax.tasks import check_grading_mode

    expensive = _task(lambda c, a: (1.0, OK), cheap=False)
    with pytest.raises(ValueError, match=r"rollout\.reward_workers=2"):
        check_grading_mode(expensive, reward_workers=0)
    check_grading_mode(expensive, reward_workers=2)  # killable workers with a deadline: fine
    check_grading_mode(_task(lambda c, a: (1.0, OK), cheap=True), reward_workers=0)


@pytest.mark.slow
def test_math_verify_power_tower_times_out_in_a_worker():
    """In a killable worker a power tower that runs math-verify for minutes costs its deadline."""
    pytest.importorskip("math_verify")
    task = get_task("math")
    tower = "\\boxed{2^{2^{2^{2^{2^{2}}}}}}"
    with RewardPool(num_workers=1, timeout_s=2.0) as pool:
        got, seconds = _timed(pool.score, task, [(tower, "4"), ("\\boxed{4}", "4")])
    assert got == [(0.0, TIMEOUT), (1.0, OK)]
    assert seconds < 90


def test_prompt_streams_shard_the_problems_or_share_them_when_too_few():
    """Searchers split the training problems; with fewer problems than searchers (one red-team
    instruction) each streams all of them. Epochs reshuffle deterministically; start resumes."""
    from tbajax.system.searcher import PromptStream

    problems = [Problem(i, f"q{i}", "a") for i in range(5)]
    a, b = PromptStream(problems, 0, 2, seed=3), PromptStream(problems, 1, 2, seed=3)
    first = [p.id for p in a.take(6)]
    assert sorted(first[:3]) == [0, 2, 4] and sorted(first[3:]) == [0, 2, 4]  # two epochs of its shard
    assert sorted(p.id for p in b.take(2)) == [1, 3]
    resumed = PromptStream(problems, 0, 2, seed=3, start=4)
    assert [p.id for p in resumed.take(2)] == first[4:6]
    one = [Problem(7, "instruction", None)]
    assert [p.id for p in PromptStream(one, 2, 3, seed=0).take(3)] == [7, 7, 7]
    with pytest.raises(ValueError, match="no training problems"):
        PromptStream([], 0, 1, seed=0)


def test_prompt_stream_order_is_one_permutation_per_epoch():
    """The stream draws each epoch's order once (not once per prompt); the problems it hands out
    are those of the per-epoch permutation of (seed, epoch), as before, so a run resumed across
    the change (or across an epoch boundary) streams the same problems."""
    from tbajax.system.searcher import PromptStream

    problems = [Problem(i, f"q{i}", "a") for i in range(7)]
    stream = PromptStream(problems, 1, 2, seed=5, start=2)
    shard = np.arange(1, 7, 2)
    expected = [int(np.random.default_rng((5, pos // 3)).permutation(shard)[pos % 3]) for pos in range(2, 12)]
    assert [p.id for p in stream.take(4)] + [p.id for p in stream.take(6)] == expected
    assert stream.order(3) is stream.order(3)  # drawn once, then reused within the epoch
