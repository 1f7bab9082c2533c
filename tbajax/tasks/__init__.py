"""Tasks: prompt sources, prompt formatting, rewards and evaluation.

Built-in tasks (`get_task(name, **config)`): arithmetic (offline default), gsm8k, gsm_symbolic
(reasoning-gym), math (MATH / MATH-500 with math-verify), countdown. A task of your own is a
function returning `Task(...)`, named as 'your_module:make_task' or registered with
`register_task`. Heavy optional packages (math_verify, reasoning_gym, datasets, tokenizers,
transformers) are imported only when a task needs them.
"""

from tbajax.tasks.base import (
    BUILTIN_TASKS,
    Problem,
    RewardFn,
    Task,
    TaskRegistry,
    available_tasks,
    check_grading_mode,
    default_evaluator,
    get_task,
    register_task,
)
from tbajax.tasks.data import DatasetUnavailableError
from tbajax.tasks.evaluation import accuracy, mean_pass_at_k, pass_at_k
from tbajax.tasks.reward_pool import RewardPool, RewardResult, call_reward

__all__ = [
    "BUILTIN_TASKS",
    "DatasetUnavailableError",
    "Problem",
    "RewardFn",
    "RewardPool",
    "RewardResult",
    "Task",
    "TaskRegistry",
    "accuracy",
    "available_tasks",
    "call_reward",
    "check_grading_mode",
    "default_evaluator",
    "get_task",
    "mean_pass_at_k",
    "pass_at_k",
    "register_task",
]
