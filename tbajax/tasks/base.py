"""The task contract: a prompt source, a prompt formatter, a reward function and an evaluator.

A `Task` is a frozen record of plain callables, so a user adds a task in their own file (a
factory returning `Task(...)`) and names it as `"my_pkg.my_tasks:make_task"` or
`"path/to/my_tasks.py:make_task"`, or registers it under a short name; nothing in tbajax changes. Reward functions travel to worker
processes by pickling, so they must be module-level functions (or `functools.partial` of one)
taking `(completion: str, answer) -> (reward: float, RewardStatus)`.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from tbajax.imports import import_object
from tbajax.tasks.evaluation import accuracy, mean_pass_at_k
from tbajax.trajectory import RewardStatus

SPLITS = ("train", "eval")


@dataclasses.dataclass(frozen=True)
class Problem:
    """One prompt of a dataset. `answer` is whatever the task's reward function expects (picklable)."""

    id: int  # stable index of the problem within its split
    question: str  # the problem text the prompt is built from
    answer: Any  # gold answer handed to the reward function
    meta: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # task-specific extras


class RewardFn(Protocol):
    def __call__(self, completion: str, answer: Any, /) -> tuple[float, RewardStatus]: ...


Evaluator = Callable[[Sequence[Sequence[float]], float], dict[str, float]]


def default_evaluator(rewards: Sequence[Sequence[float]], success_threshold: float) -> dict[str, float]:
    """Metrics from per-problem lists of sample rewards: accuracy of the first sample, mean reward,
    and unbiased pass@k for k = 1, 2, 4, ... up to the smallest number of samples per problem."""
    if not rewards:
        raise ValueError("default_evaluator got no problems to evaluate")
    if any(len(r) == 0 for r in rewards):
        raise ValueError("default_evaluator got a problem with no samples")
    flat = [x for r in rewards for x in r]
    metrics = {
        "accuracy": accuracy([r[0] for r in rewards], success_threshold),
        "mean_reward": math.fsum(flat) / len(flat),
    }
    n_min = min(len(r) for r in rewards)
    if n_min > 1:
        k = 1
        while k <= n_min:
            metrics[f"pass@{k}"] = mean_pass_at_k(rewards, k, success_threshold)
            k *= 2
    return metrics


@dataclasses.dataclass(frozen=True)
class Task:
    """A task: data (`load`), prompt text (`prompt`), reward (`reward_fn`) and eval metrics.

    `prompt_fn(problem)` gives the user message (what a chat model sees inside the template);
    `plain_prompt_fn(problem)`, if given, the whole raw-text prompt for base models (defaults to
    `prompt_fn`). `chat=True` renders through the tokenizer's chat template instead.
    `cheap_reward=True` lets a reward pool score in-process (still catching exceptions) instead
    of in a killable worker: only for graders that cannot hang (regexes, exact compares).
    `success_threshold`: a sample counts as solved when its reward is >= this (for accuracy, pass@k).
    `few_shot`: worked examples, (problem, reply) pairs, shown before the question: as earlier
    user/assistant turns in chat mode, as `prompt + reply` blocks separated by a blank line in
    plain mode. Small models often need one to find the answer format at all.
    """

    name: str
    load_fn: Callable[[str], Sequence[Problem]]
    prompt_fn: Callable[[Problem], str]
    reward_fn: RewardFn
    plain_prompt_fn: Callable[[Problem], str] | None = None
    cheap_reward: bool = False
    chat: bool = False
    system_prompt: str | None = None
    success_threshold: float = 1.0
    evaluator: Evaluator = default_evaluator
    few_shot: tuple[tuple[Problem, str], ...] = ()
    # Model-backed scoring (reward models, a victim LM + classifier): built once per process from a
    # `tbajax.tasks.scoring.ScorerContext`; None grades each sample with `reward_fn`.
    scorer: Any = None  # ScorerFactory: (task, ScorerContext) -> Scorer
    # eval metrics from every eval sample and its scores/extras (attack success, diversity, win
    # rate); None: `evaluator` over the rewards. `headline_metric` names the one that
    # `eval_score`, the progress bar and the learning curve show.
    eval_fn: Callable[[Any, Any], dict[str, float]] | None = None
    headline_metric: str = "accuracy"

    def load(self, split: str) -> Sequence[Problem]:
        """Problems of `split` ("train" or "eval"); deterministic for a given task config."""
        if split not in SPLITS:
            raise ValueError(f"task {self.name!r}: unknown split {split!r}; use one of {SPLITS}")
        return self.load_fn(split)

    def prompt(self, problem: Problem, tokenizer: Any = None) -> str:
        """The prompt text to tokenize. Chat prompts already hold the template's special tokens, so
        encode them with `add_special_tokens=False`."""
        if not self.chat:
            plain = self.plain_prompt_fn or self.prompt_fn
            return "".join(f"{plain(demo)}{reply}\n\n" for demo, reply in self.few_shot) + plain(problem)
        if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(
                f"task {self.name!r} has chat=True but the tokenizer has no chat template; "
                "pass a tokenizer with one, or set task.chat=False for plain-text prompts"
            )
        messages = []
        if self.system_prompt is not None:
            messages.append({"role": "system", "content": self.system_prompt})
        for demo, reply in self.few_shot:
            messages.append({"role": "user", "content": self.prompt_fn(demo)})
            messages.append({"role": "assistant", "content": reply})
        messages.append({"role": "user", "content": self.prompt_fn(problem)})
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        if not isinstance(text, str):
            raise TypeError(f"apply_chat_template returned {type(text).__name__}, expected str")
        return text

    def reward(self, completion: str, answer: Any) -> tuple[float, RewardStatus]:
        """Score one completion in-process (no timeout: use `RewardPool` for untrusted graders)."""
        return self.reward_fn(completion, answer)

    def evaluate(self, rewards: Sequence[Sequence[float]]) -> dict[str, float]:
        """Eval metrics from per-problem sample rewards (first sample = the greedy one, if any)."""
        return self.evaluator(rewards, self.success_threshold)


def check_grading_mode(task: Task, reward_workers: int) -> None:
    """Refuse to grade an expensive task in-process: there a grader that hangs (math-verify on a
    tower of powers, a user's slow checker) freezes the searcher and the trainer's evaluation with
    no time limit and no output. Only a worker process can be killed at a deadline."""
    if task.cheap_reward or reward_workers > 0:
        return
    raise ValueError(
        f"task {task.name!r} has cheap_reward=False (its grader can be slow or hang) but "
        "rollout.reward_workers=0 would grade it inside the searcher and trainer processes, with no "
        "time limit. Grade it in killable worker processes with a per-sample deadline: "
        "--set rollout.reward_workers=2 (the deadline is rollout.reward_timeout_s); or, if the grader "
        "cannot hang (a regex, an exact compare), mark the task cheap_reward=True"
    )


TaskFactory = Callable[..., Task]

# Built-in tasks, named by import path so that looking a name up imports only that task's module.
BUILTIN_TASKS: Mapping[str, str] = {
    "arithmetic": "tbajax.tasks.arithmetic:arithmetic_task",
    "gsm8k": "tbajax.tasks.gsm8k:gsm8k_task",
    "gsm_symbolic": "tbajax.tasks.gsm8k:gsm_symbolic_task",
    "math": "tbajax.tasks.hendrycks_math:math_task",
    "countdown": "tbajax.tasks.countdown:countdown_task",
    "preference": "tbajax.tasks.preference:preference_task",
    "redteam": "tbajax.tasks.redteam:redteam_task",
}


def _import_object(path: str) -> Any:
    return import_object(path, "task")


def _build(spec: Any, label: str, kwargs: Mapping[str, Any]) -> Task:
    if isinstance(spec, Task):
        return dataclasses.replace(spec, **kwargs) if kwargs else spec
    if not callable(spec):
        raise TypeError(f"task {label!r} resolved to {type(spec).__name__}, expected a Task or a factory")
    try:
        inspect.signature(spec).bind(**kwargs)
    except TypeError as e:
        raise TypeError(
            f"task {label!r} does not accept {sorted(kwargs)}: {e}; its parameters are {inspect.signature(spec)}"
        ) from None
    except ValueError:  # builtins without a signature: let the call report
        pass
    task = spec(**kwargs)
    if not isinstance(task, Task):
        raise TypeError(f"task factory {label!r} returned {type(task).__name__}, expected tbajax.tasks.Task")
    return task


class TaskRegistry:
    """Names -> task factories (or Task objects or 'module:attr' paths), resolved on lookup."""

    def __init__(self, entries: Mapping[str, Any] | None = None):
        self._entries: dict[str, Any] = dict(entries or {})

    def register(self, name: str, factory: TaskFactory | Task | str, *, overwrite: bool = False) -> None:
        if not overwrite and name in self._entries:
            raise ValueError(f"task {name!r} is already registered; pass overwrite=True to replace it")
        self._entries[name] = factory

    def names(self) -> list[str]:
        return sorted(self._entries)

    def get(self, spec: str | Task | TaskFactory, **kwargs: Any) -> Task:
        """A Task from a registered name, a 'module:factory' or 'file.py:factory' path, a Task, or a
        factory; `kwargs` configure the factory (or replace fields of a Task)."""
        if isinstance(spec, Task) or (callable(spec) and not isinstance(spec, str)):
            return _build(spec, getattr(spec, "name", repr(spec)), kwargs)
        if not isinstance(spec, str):
            raise TypeError(f"task spec must be a name, 'module:factory', Task or factory, got {type(spec).__name__}")
        if spec in self._entries:
            entry = self._entries[spec]
            return _build(_import_object(entry) if isinstance(entry, str) else entry, spec, kwargs)
        if ":" in spec:
            return _build(_import_object(spec), spec, kwargs)
        raise KeyError(
            f"unknown task {spec!r}; known tasks: {self.names()}. A task of your own can be named as "
            "'your_module:make_task' or 'path/to/file.py:make_task' (a function returning tbajax.tasks.Task), "
            "or registered with register_task"
        )


DEFAULT_REGISTRY = TaskRegistry(BUILTIN_TASKS)


def register_task(name: str, factory: TaskFactory | Task | str, *, overwrite: bool = False) -> None:
    """Register a task in the default registry. Registration lives in this process only: worker
    processes started with spawn do not see it, so prefer 'module:factory' paths in configs."""
    DEFAULT_REGISTRY.register(name, factory, overwrite=overwrite)


def get_task(spec: str | Task | TaskFactory, **kwargs: Any) -> Task:
    """Resolve a task spec in the default registry (see `TaskRegistry.get`)."""
    return DEFAULT_REGISTRY.get(spec, **kwargs)


def available_tasks() -> list[str]:
    return DEFAULT_REGISTRY.names()
