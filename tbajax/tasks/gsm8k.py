"""GSM8K (and reasoning-gym's GSM-Symbolic): the TBA prompt and last-number / strict graders.

Numbers are compared exactly as rationals (Fraction), so "3.50" equals "3.5" and "1,000" equals
"1000". A number is: an optional sign, an optional "$", digits with optional thousands commas
("1,234,567"), an optional decimal part, an optional exponent ("1.5e3"). A "-" counts as a sign
only when it is not glued to a preceding word or ")" (so "10-3" is 10 and 3, "is -3" is -3).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any

from tbajax.tasks.base import Problem, Task
from tbajax.tasks.data import load_split_records, reasoning_gym_split
from tbajax.trajectory import RewardStatus

PROMPT_TEMPLATE = "[MATH TASK] Problem:\n{question}\n\nSolution:\n"

_NUM = r"(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)(?:[eE][+-]?\d{1,3}(?!\d))?"
_SIGNED = rf"(?:(?<![\w)\]])-)?\$?(?:{_NUM})"
NUMBER_RE = re.compile(_SIGNED)
_STRICT_RE = re.compile(rf"####\s*+({_SIGNED})")
# Possessive `\s*+`: whitespace is never given back (nothing after it can start with whitespace),
# so "the answer is" followed by n spaces costs O(n), not the O(n^4) of four backtracking `\s*`.
_ANSWER_IS_RE = re.compile(
    rf"the\s++(?:final\s++)?answer\s++is\s*+:?\s*+\$?\s*+(?:\\boxed\{{)?\s*+({_SIGNED})", re.IGNORECASE
)


def parse_number(text: str) -> Fraction:
    """The exact value of one number as matched by `NUMBER_RE` ("$1,234.50" -> 2469/2)."""
    s = text.replace(",", "").replace("$", "")
    return Fraction(s)


def last_number(text: str) -> Fraction | None:
    """The value of the last number in `text`, or None when it has none."""
    last = None
    for last in NUMBER_RE.finditer(text):
        pass
    return None if last is None else parse_number(last.group(0))


def strict_number(text: str) -> Fraction | None:
    """The number after the last '#### ' marker (GSM8K's gold format), or None."""
    matches = _STRICT_RE.findall(text)
    return parse_number(matches[-1]) if matches else None


def answer_is_number(text: str) -> Fraction | None:
    """The number after the last 'The answer is' (case-insensitive), or None."""
    matches = _ANSWER_IS_RE.findall(text)
    return parse_number(matches[-1]) if matches else None


def _grade(extract: Callable[[str], Fraction | None], completion: str, answer: str) -> tuple[float, RewardStatus]:
    try:
        pred = extract(completion)
    except ValueError:  # a number too long to convert (Python caps int parsing at 4300 digits)
        return 0.0, RewardStatus.WRONG
    if pred is None:
        return 0.0, RewardStatus.NO_ANSWER
    return (1.0, RewardStatus.OK) if pred == Fraction(answer) else (0.0, RewardStatus.WRONG)


def last_number_reward(completion: str, answer: str) -> tuple[float, RewardStatus]:
    """1 if the last number of the completion equals the gold number (`answer`, e.g. "72")."""
    return _grade(last_number, completion, answer)


def strict_reward(completion: str, answer: str) -> tuple[float, RewardStatus]:
    """1 if the completion's last '#### N' equals the gold number."""
    return _grade(strict_number, completion, answer)


def answer_is_reward(completion: str, answer: str) -> tuple[float, RewardStatus]:
    """1 if the completion's last 'The answer is N' equals the gold number."""
    return _grade(answer_is_number, completion, answer)


GRADERS: dict[str, Callable[[str, str], tuple[float, RewardStatus]]] = {
    "last_number": last_number_reward,
    "strict": strict_reward,
    "answer_is": answer_is_reward,
}


def gold_number(gold_solution: str) -> str:
    """Canonical gold answer string (an exact rational, e.g. "72", "-3", "7/2") from a GSM8K
    gold solution: the number after '####', else the last number."""
    value = strict_number(gold_solution)
    if value is None:
        value = last_number(gold_solution)
    if value is None:
        raise ValueError(f"gold answer has no number: {gold_solution[-200:]!r}")
    return str(value)


def gsm8k_prompt(problem: Problem) -> str:
    return PROMPT_TEMPLATE.format(question=problem.question)


def _question_only(problem: Problem) -> str:
    return problem.question


def records_to_problems(
    records: Sequence[dict[str, Any]], *, question_field: str, answer_field: str, source: str
) -> list[Problem]:
    problems = []
    for i, row in enumerate(records):
        missing = [f for f in (question_field, answer_field) if f not in row]
        if missing:
            raise ValueError(f"{source}: row {i} lacks field(s) {missing}; it has {sorted(row)}")
        try:
            answer = gold_number(str(row[answer_field]))
        except ValueError as e:
            raise ValueError(f"{source}: row {i}: {e}") from None
        problems.append(Problem(id=i, question=str(row[question_field]), answer=answer, meta={"solution": row[answer_field]}))
    return problems


def _load_gsm8k(split: str, *, data_path, train_path, eval_path, hub, question_field, answer_field) -> list[Problem]:
    records = load_split_records(
        task="gsm8k",
        split=split,
        fields=f"{question_field}/{answer_field}",
        split_names=("train",) if split == "train" else ("test", "eval"),
        data_path=data_path,
        split_path=train_path if split == "train" else eval_path,
        hub=None if hub is None else (hub[0], hub[1], "train" if split == "train" else "test"),
    )
    return records_to_problems(records, question_field=question_field, answer_field=answer_field, source=f"gsm8k/{split}")


def _grader(name: str):
    if name not in GRADERS:
        raise ValueError(f"unknown GSM8K grader {name!r}; use one of {sorted(GRADERS)}")
    return GRADERS[name]


def gsm8k_task(
    *,
    data_path: str | None = None,
    train_path: str | None = None,
    eval_path: str | None = None,
    hub_id: str | None = "openai/gsm8k",
    hub_config: str | None = "main",
    question_field: str = "question",
    answer_field: str = "answer",
    grader: str = "last_number",
    chat: bool = False,
    system_prompt: str | None = None,
) -> Task:
    """GSM8K with the TBA prompt. Data: `train_path`/`eval_path` files, else `data_path` (a folder
    with train.* / test.*, or a pattern with '{split}'), else the hub via `datasets` when online."""
    load = functools.partial(
        _load_gsm8k,
        data_path=data_path,
        train_path=train_path,
        eval_path=eval_path,
        hub=None if hub_id is None else (hub_id, hub_config),
        question_field=question_field,
        answer_field=answer_field,
    )
    return _gsm_task("gsm8k", load, grader, chat, system_prompt)


def _gsm_task(name: str, load: Any, grader: str, chat: bool, system_prompt: str | None) -> Task:
    """GSM8K's prompt and graders over any loader of word problems."""
    return Task(
        name=name,
        load_fn=load,
        prompt_fn=_question_only,
        plain_prompt_fn=gsm8k_prompt,
        reward_fn=_grader(grader),
        cheap_reward=True,
        chat=chat,
        system_prompt=system_prompt,
    )


# --- GSM-Symbolic, generated offline by reasoning-gym ------------------------------------------


def _rg_question(item: dict) -> str:
    return item["question"]


def _load_gsm_symbolic(split: str, *, sizes: dict[str, int], seed: int, eval_fraction: float) -> list[Problem]:
    items = reasoning_gym_split(
        "gsm_symbolic", split, sizes[split], seed=seed, eval_fraction=eval_fraction, key=_rg_question
    )
    return [
        Problem(id=i, question=item["question"], answer=str(Fraction(str(item["answer"]))), meta={})
        for i, item in enumerate(items)
    ]


def gsm_symbolic_task(
    *,
    seed: int = 0,
    num_train: int = 20_000,
    num_eval: int = 500,
    eval_fraction: float = 0.1,
    grader: str = "last_number",
    chat: bool = False,
    system_prompt: str | None = None,
) -> Task:
    """GSM-style word problems generated offline by reasoning-gym, with the GSM8K prompt and graders."""
    load = functools.partial(
        _load_gsm_symbolic, sizes={"train": num_train, "eval": num_eval}, seed=seed, eval_fraction=eval_fraction
    )
    return _gsm_task("gsm_symbolic", load, grader, chat, system_prompt)
