"""Countdown: combine the given numbers with + - * / into an equation that hits the target.

Scoring follows TinyZero: 1.0 if the last <answer>...</answer> holds an expression that uses each
given number exactly once and equals the target, `format_score` (0.1) if it is a well-formed
expression that misses (wrong numbers, wrong value, division by zero), 0 if there is no answer or it
is not a well-formed expression. Expressions are checked by a small AST evaluator over exact
rationals that admits only integer literals, binary + - * / and parentheses, within size and depth
bounds; nothing is ever passed to `eval`, and there is no power operator, so inputs such as
`99**87**45` are rejected before any arithmetic happens.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import random
from collections import Counter
from collections.abc import Sequence
from fractions import Fraction

from tbajax.tasks.base import Problem, Task
from tbajax.tasks.data import LazyProblems, draw_for_split, reasoning_gym_split
from tbajax.trajectory import RewardStatus


class ExpressionError(ValueError):
    """Not a well-formed Countdown expression (disallowed syntax, too large, or unparsable)."""


@dataclasses.dataclass(frozen=True)
class Limits:
    max_chars: int = 256
    max_nodes: int = 64  # AST nodes (literals + operators)
    max_depth: int = 16  # nesting of operators
    max_literal: int = 10**6


_ALLOWED_CHARS = frozenset("0123456789+-*/() \t\n")
_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}


def parse_expression(expr: str, limits: Limits = Limits()) -> ast.expr:
    """The AST of a Countdown expression, or ExpressionError saying why it is not one."""
    if len(expr) > limits.max_chars:
        raise ExpressionError(f"expression longer than {limits.max_chars} characters")
    bad = sorted(set(expr) - _ALLOWED_CHARS)
    if bad:
        raise ExpressionError(f"characters not allowed: {''.join(bad)!r} (only digits, + - * / and parentheses)")
    if "**" in expr:
        raise ExpressionError("the power operator is not allowed")
    text = expr.strip()
    if not text:
        raise ExpressionError("empty expression")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise ExpressionError(f"not a valid expression: {type(e).__name__}: {e}") from None
    nodes = 0

    def check(node: ast.AST, depth: int) -> None:
        nonlocal nodes
        nodes += 1
        if nodes > limits.max_nodes:
            raise ExpressionError(f"expression has more than {limits.max_nodes} nodes")
        if depth > limits.max_depth:
            raise ExpressionError(f"expression nested deeper than {limits.max_depth}")
        if isinstance(node, ast.BinOp):
            if type(node.op) not in _OPS:
                raise ExpressionError(f"operator {type(node.op).__name__} is not allowed (only + - * /)")
            check(node.left, depth + 1)
            check(node.right, depth + 1)
        elif isinstance(node, ast.Constant):
            if type(node.value) is not int:
                raise ExpressionError(f"literal {node.value!r} is not an integer")
            if node.value > limits.max_literal:
                raise ExpressionError(f"literal larger than {limits.max_literal}")
        else:
            raise ExpressionError(f"{type(node).__name__} is not allowed (only integers, + - * / and parentheses)")

    check(tree.body, 0)
    return tree.body


def literals(node: ast.expr) -> list[int]:
    """The integer literals of a parsed expression, left to right."""
    if isinstance(node, ast.BinOp):
        return literals(node.left) + literals(node.right)
    assert isinstance(node, ast.Constant)
    return [node.value]


def evaluate(node: ast.expr) -> Fraction:
    """Exact value of a parsed expression; ZeroDivisionError on division by zero."""
    if isinstance(node, ast.Constant):
        return Fraction(node.value)
    assert isinstance(node, ast.BinOp)
    a, b = evaluate(node.left), evaluate(node.right)
    op = _OPS[type(node.op)]
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    return a / b


def safe_eval(expr: str, limits: Limits = Limits()) -> Fraction:
    """Parse and evaluate a Countdown expression exactly (ExpressionError / ZeroDivisionError)."""
    return evaluate(parse_expression(expr, limits))


@dataclasses.dataclass(frozen=True)
class CountdownAnswer:
    target: int
    numbers: tuple[int, ...]


_OPEN, _CLOSE = "<answer>", "</answer>"


def extract_answer(completion: str) -> str | None:
    """Content of the last <answer>...</answer>, or None.

    The pairs are those of the non-greedy regex `<answer>(.*?)</answer>` scanned left to right
    (each opening tag closes at the first closing tag after it), found with `str.find` in one
    forward pass: the regex costs O(n^2) on a completion of n unclosed `<answer>` tags, since
    every one of them scans to the end."""
    last, pos = None, 0
    while (start := completion.find(_OPEN, pos)) >= 0:
        end = completion.find(_CLOSE, start + len(_OPEN))
        if end < 0:  # no closing tag after this opening one, so none after any later one either
            break
        last, pos = (start + len(_OPEN), end), end + len(_CLOSE)
    return None if last is None else completion[last[0]:last[1]].strip()


def countdown_reward(
    completion: str,
    answer: CountdownAnswer,
    *,
    format_score: float = 0.1,
    limits: Limits = Limits(),
) -> tuple[float, RewardStatus]:
    """TinyZero scoring: 1 correct, `format_score` well-formed but wrong, 0 no / malformed answer."""
    text = extract_answer(completion)
    if text is None:
        return 0.0, RewardStatus.NO_ANSWER
    try:
        tree = parse_expression(text, limits)
    except ExpressionError:
        return 0.0, RewardStatus.NO_ANSWER
    if Counter(literals(tree)) != Counter(answer.numbers):
        return format_score, RewardStatus.WRONG
    try:
        value = evaluate(tree)
    except ZeroDivisionError:
        return format_score, RewardStatus.WRONG
    return (1.0, RewardStatus.OK) if value == answer.target else (format_score, RewardStatus.WRONG)


# --- prompts ------------------------------------------------------------------------------------


def instruction(problem: Problem, template: str | None = None) -> str:
    """The user message: TinyZero's instruction, or `template` with {numbers} and {target} filled in."""
    a: CountdownAnswer = problem.answer
    if template is not None:
        return template.format(numbers=list(a.numbers), target=a.target)
    return (
        f"Using the numbers {list(a.numbers)}, write an equation that equals {a.target}. You may use "
        "+, -, * and / and parentheses, and must use every number exactly once. Think it through "
        "inside <think> </think> tags, then give only the equation inside <answer> </answer> tags, "
        "for example <answer> (1 + 2) / 3 </answer>."
    )


def plain_prompt(problem: Problem, template: str | None = None) -> str:
    """TinyZero-style raw-text prompt for base models: a User/Assistant exchange that opens the
    assistant's turn with a thinking tag."""
    return (
        "A conversation between User and Assistant. The user asks a question, and the assistant "
        "solves it: it first reasons about the problem in its mind, then gives the user the answer.\n"
        f"User: {instruction(problem, template)}\n"
        "Assistant: Let me solve this step by step.\n<think>"
    )


# --- data ---------------------------------------------------------------------------------------


def _key(numbers: Sequence[int], target: int) -> str:
    return f"{sorted(numbers)}->{target}"


def _random_puzzle(
    rng: random.Random,
    num_numbers: tuple[int, int],
    max_number: int,
    target_range: tuple[int, int],
    max_tries: int = 10_000,
) -> tuple[tuple[int, ...], int, str]:
    """Random numbers combined by random operations until the result is an integer target in
    range: solvable by construction, with the generating expression as a witness."""
    for _ in range(max_tries):
        numbers = [rng.randint(1, max_number) for _ in range(rng.randint(*num_numbers))]
        pool: list[tuple[Fraction, str]] = [(Fraction(x), str(x)) for x in numbers]
        while len(pool) > 1:
            i, j = rng.sample(range(len(pool)), 2)
            (a, ea), (b, eb) = pool[i], pool[j]
            op = rng.choice("+-*/")
            if op == "-" and a < b:
                (a, ea), (b, eb) = (b, eb), (a, ea)
            if op == "/" and (b == 0 or (a / b).denominator != 1):
                op = "+"
            value = {"+": a + b, "-": a - b, "*": a * b, "/": a / b if b else a}[op]
            pool = [p for k, p in enumerate(pool) if k not in (i, j)] + [(value, f"({ea} {op} {eb})")]
        value, expr = pool[0]
        if value.denominator == 1 and target_range[0] <= value <= target_range[1]:
            shown = list(numbers)
            rng.shuffle(shown)
            return tuple(shown), int(value), expr[1:-1] if expr.startswith("(") else expr
    raise RuntimeError(f"no Countdown puzzle with a target in {target_range} after {max_tries} tries")


def _builtin_candidate(index: int, attempt: int, *, split: str, seed: int, **gen) -> tuple:
    return _random_puzzle(random.Random(f"countdown:{seed}:{split}:{index}:{attempt}"), **gen)


def _builtin_problem(index: int, *, split: str, seed: int, eval_fraction: float, **gen) -> Problem:
    numbers, target, witness = draw_for_split(
        split,
        index,
        seed=seed,
        eval_fraction=eval_fraction,
        candidate=functools.partial(_builtin_candidate, split=split, seed=seed, **gen),
        key=lambda t: _key(t[0], t[1]),
    )
    return _problem(index, numbers, target, witness)


def _problem(index: int, numbers: Sequence[int], target: int, witness: str) -> Problem:
    answer = CountdownAnswer(target=int(target), numbers=tuple(int(x) for x in numbers))
    return Problem(id=index, question=f"numbers {list(answer.numbers)} target {target}", answer=answer, meta={"solution": witness})


def _rg_key(item: dict) -> str:
    return _key(item["metadata"]["numbers"], item["metadata"]["target"])


def _load(split: str, *, source: str, sizes: dict[str, int], seed: int, eval_fraction: float, gen: dict) -> Sequence[Problem]:
    n = sizes[split]
    if source == "builtin":
        return LazyProblems(
            n, functools.partial(_builtin_problem, split=split, seed=seed, eval_fraction=eval_fraction, **gen)
        )
    config = dict(
        min_numbers=gen["num_numbers"][0],
        max_numbers=gen["num_numbers"][1],
        min_value=1,
        max_value=gen["max_number"],
        min_target=gen["target_range"][0],
        max_target=gen["target_range"][1],
    )
    items = reasoning_gym_split("countdown", split, n, seed=seed, eval_fraction=eval_fraction, key=_rg_key, config=config)
    return [
        _problem(i, it["metadata"]["numbers"], it["metadata"]["target"], it["metadata"].get("expression", ""))
        for i, it in enumerate(items)
    ]


SOURCES = ("builtin", "reasoning_gym")


def demonstrations(n: int, *, seed: int, eval_fraction: float, gen: dict) -> tuple[tuple[Problem, str], ...]:
    """`n` worked examples with their generating equation as the reply, drawn from the train side of
    the content split, so that no demonstration is ever an eval puzzle."""
    demos = []
    for i in range(n):
        numbers, target, witness = draw_for_split(
            "train", i, seed=seed, eval_fraction=eval_fraction,
            candidate=functools.partial(_builtin_candidate, split="demo", seed=seed, **gen),
            key=lambda t: _key(t[0], t[1]),
        )
        demos.append((_problem(-1 - i, numbers, target, witness), f"<answer> {witness} </answer>"))
    return tuple(demos)


def countdown_task(
    *,
    source: str = "builtin",
    seed: int = 0,
    num_numbers: tuple[int, int] = (3, 4),
    max_number: int = 99,
    target_range: tuple[int, int] = (1, 100),
    num_train: int = 1_000_000,
    num_eval: int = 500,
    eval_fraction: float = 0.1,
    format_score: float = 0.1,
    chat: bool = False,
    system_prompt: str | None = None,
    prompt_template: str | None = None,
    few_shot: int = 0,
) -> Task:
    """Countdown puzzles generated offline: `builtin` (this module, lazily, solvable by construction)
    or `reasoning_gym` (reasoning-gym's generator; ~15 ms a puzzle, materialised at load).

    prompt_template: the user message with {numbers} and {target} (default: TinyZero's instruction).
    few_shot: solved train-side puzzles shown before the question (see `Task.few_shot`).
    """
    if source not in SOURCES:
        raise ValueError(f"unknown countdown source {source!r}; use one of {SOURCES}")
    lo, hi = num_numbers
    if not (2 <= lo <= hi):
        raise ValueError(f"num_numbers must be (lo, hi) with 2 <= lo <= hi, got {num_numbers}")
    if not (1 <= target_range[0] <= target_range[1]):
        raise ValueError(f"target_range must be (lo, hi) with 1 <= lo <= hi, got {target_range}")
    if few_shot < 0:
        raise ValueError(f"few_shot must be >= 0, got {few_shot}")
    if prompt_template is not None:
        try:
            prompt_template.format(numbers=[1, 2], target=3)
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(
                f"prompt_template {prompt_template!r} does not format: {type(e).__name__}: {e}; "
                "the only fields are {numbers} and {target} (write literal braces as {{ }})"
            ) from None
    gen = dict(num_numbers=(lo, hi), max_number=max_number, target_range=tuple(target_range))
    load = functools.partial(
        _load, source=source, sizes={"train": num_train, "eval": num_eval}, seed=seed, eval_fraction=eval_fraction, gen=gen
    )
    return Task(
        name="countdown",
        load_fn=load,
        prompt_fn=functools.partial(instruction, template=prompt_template),
        plain_prompt_fn=functools.partial(plain_prompt, template=prompt_template),
        reward_fn=functools.partial(countdown_reward, format_score=format_score),
        cheap_reward=True,
        chat=chat,
        system_prompt=system_prompt,
        few_shot=demonstrations(few_shot, seed=seed, eval_fraction=eval_fraction, gen=gen),
    )
