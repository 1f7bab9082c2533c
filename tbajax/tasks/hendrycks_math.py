"""MATH / MATH-500: the last \\boxed{} (or \\fbox{}) answer, checked for equivalence by math-verify.

math-verify can take unbounded time on adversarial LaTeX and its own signal-based timeout only
works on a main thread, so this task is marked expensive: `RewardPool` runs it in a killable
worker process with a timeout, and math-verify's internal timeouts are switched off. With
rollout.reward_workers=0 it would be graded in-process with no limit (a power tower such as
2^{2^{2^{2^{2^{2}}}}} ran past 30 s), so the launcher refuses that configuration.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Sequence
from typing import Any

from tbajax.tasks.base import Problem, Task
from tbajax.tasks.data import load_split_records
from tbajax.trajectory import RewardStatus

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
_BOX_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} / \\fbox{...} by a balanced-brace scan (escaped \\{ \\} do
    not count), or of the short form '\\boxed 5'; None if absent, unbalanced or empty."""
    matches = list(_BOX_RE.finditer(text))
    if not matches:
        return None
    i = matches[-1].end()
    n = len(text)
    while i < n and text[i] == " ":
        i += 1
    if i < n and text[i] == "{":
        depth, start, j = 0, i + 1, i
        while j < n:
            c = text[j]
            if c == "\\":
                j += 2
                continue
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
                if depth == 0:
                    content = text[start:j].strip()
                    return content or None
            j += 1
        return None
    m = re.match(r"[^\s$]+", text[i:])  # "\boxed 5" form: up to whitespace or '$'
    return m.group(0) if m and i > matches[-1].end() else None


_STRIP_PATTERNS = (r"\\left", r"\\right", r"\\!", r"\\,", r"\\;", r"\\:", r"\$", r"\\displaystyle")


def normalize_answer(s: str) -> str:
    """Light LaTeX normalisation for the opt-in string fallback (not an equivalence check)."""
    s = s.strip()
    m = re.fullmatch(r"\\text\{(.*)\}", s)
    if m:
        s = m.group(1)
    for p in _STRIP_PATTERNS:
        s = re.sub(p, "", s)
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = re.sub(r"\^\{?\\circ\}?", "", s)
    s = s.replace(" ", "").rstrip(".")
    return s


class _DropTimeoutDisabledWarning(logging.Filter):
    """math-verify warns once per process that its timeout is off; here that is on purpose."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


def _quiet_math_verify() -> None:
    for name in ("math_verify.parser", "math_verify.grader"):
        log = logging.getLogger(name)
        if not any(isinstance(f, _DropTimeoutDisabledWarning) for f in log.filters):
            log.addFilter(_DropTimeoutDisabledWarning())


def _verify_with_math_verify(pred: str, gold: str) -> bool:
    import math_verify

    _quiet_math_verify()

    gold_parsed = math_verify.parse(f"${gold}$", parsing_timeout=None)
    pred_parsed = math_verify.parse(f"${pred}$", parsing_timeout=None)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(math_verify.verify(gold_parsed, pred_parsed, timeout_seconds=None))


def math_reward(completion: str, answer: str, *, string_fallback: bool = False) -> tuple[float, RewardStatus]:
    """1 if the last boxed answer is equivalent to `answer` (math-verify); NO_ANSWER if none boxed.
    Without math-verify installed this raises, unless `string_fallback` (normalised string equality)."""
    pred = last_boxed(completion)
    if pred is None:
        return 0.0, RewardStatus.NO_ANSWER
    try:
        import math_verify  # noqa: F401
    except ImportError:
        if not string_fallback:
            raise ImportError(
                "the MATH grader needs math-verify (pip install math-verify); or opt in to plain normalised "
                "string comparison with task.string_fallback=True"
            ) from None
        ok = normalize_answer(pred) == normalize_answer(answer)
    else:
        ok = pred.strip() == answer.strip() or _verify_with_math_verify(pred, answer)
    return (1.0, RewardStatus.OK) if ok else (0.0, RewardStatus.WRONG)


def math_prompt(problem: Problem) -> str:
    return f"{problem.question}\n{INSTRUCTION}"


def records_to_problems(records: Sequence[dict[str, Any]], *, source: str) -> list[Problem]:
    """Rows with 'problem' and 'answer' (MATH-500) or 'solution' (MATH, answer = its last box)."""
    problems = []
    for i, row in enumerate(records):
        if "problem" not in row:
            raise ValueError(f"{source}: row {i} lacks field 'problem'; it has {sorted(row)}")
        if row.get("answer") is not None:
            answer = str(row["answer"])
        elif row.get("solution") is not None:
            answer = last_boxed(str(row["solution"]))
            if answer is None:
                raise ValueError(f"{source}: row {i}: solution has no \\boxed{{}} answer")
        else:
            raise ValueError(f"{source}: row {i} has neither 'answer' nor 'solution'; it has {sorted(row)}")
        meta = {k: row[k] for k in ("level", "type", "subject", "unique_id") if k in row}
        problems.append(Problem(id=i, question=str(row["problem"]), answer=answer, meta=meta))
    return problems


def _load(split: str, *, data_path, train_path, eval_path, train_hub, eval_hub) -> list[Problem]:
    records = load_split_records(
        task="math",
        split=split,
        fields="problem + answer (or solution with a \\boxed{} answer)",
        split_names=("train",) if split == "train" else ("test", "eval"),
        data_path=data_path,
        split_path=train_path if split == "train" else eval_path,
        hub=train_hub if split == "train" else eval_hub,
    )
    return records_to_problems(records, source=f"math/{split}")


def math_task(
    *,
    data_path: str | None = None,
    train_path: str | None = None,
    eval_path: str | None = None,
    train_hub: tuple[str, str | None, str] | None = ("DigitalLearningGmbH/MATH-lighteval", None, "train"),
    eval_hub: tuple[str, str | None, str] | None = ("HuggingFaceH4/MATH-500", None, "test"),
    string_fallback: bool = False,
    chat: bool = False,
    system_prompt: str | None = None,
) -> Task:
    """MATH train / MATH-500 eval with boxed answers checked by math-verify in a killable worker."""
    if not string_fallback:
        try:
            import math_verify  # noqa: F401
        except ImportError:
            raise ImportError(
                "the math task needs math-verify (pip install math-verify); or set task.string_fallback=True "
                "to grade by normalised string equality instead"
            ) from None
    load = functools.partial(
        _load,
        data_path=data_path,
        train_path=train_path,
        eval_path=eval_path,
        train_hub=None if train_hub is None else tuple(train_hub),
        eval_hub=None if eval_hub is None else tuple(eval_hub),
    )
    return Task(
        name="math",
        load_fn=load,
        prompt_fn=math_prompt,
        reward_fn=functools.partial(math_reward, string_fallback=string_fallback),
        cheap_reward=False,
        chat=chat,
        system_prompt=system_prompt,
    )
