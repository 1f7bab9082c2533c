"""Arithmetic: the tiny offline default task ("123+456=" -> "579"), and its character tokenizer.

Problems are generated, not downloaded: problem i of a split comes from a PRNG seeded by
(seed, split, i), and a content hash sends every (a, op, b) to exactly one split, so train and
eval are disjoint by construction and reproducible from the config alone.
"""

from __future__ import annotations

import functools
import os
import random
from collections.abc import Sequence

from tbajax.tasks.base import Problem, Task
from tbajax.tasks.data import LazyProblems, draw_for_split
from tbajax.trajectory import RewardStatus

OPERATORS = ("+", "-", "*")

# Character tokenizer vocabulary: specials first (pad=0, bos=1, eos=2, unk=3, as the tiny test
# models expect), then every character an arithmetic prompt or answer can contain.
PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
CHAR_VOCAB: tuple[str, ...] = (PAD, BOS, EOS, UNK, *"0123456789", "+", "-", "*", "=", " ")


def _operand_range(digits: int) -> tuple[int, int]:
    return (0, 9) if digits == 1 else (10 ** (digits - 1), 10**digits - 1)


def _apply(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def _draw(rng: random.Random, digits: int, operators: Sequence[str], nonnegative: bool) -> tuple[int, str, int]:
    lo, hi = _operand_range(digits)
    a, b, op = rng.randint(lo, hi), rng.randint(lo, hi), rng.choice(operators)
    if op == "-" and nonnegative and a < b:
        a, b = b, a
    return a, op, b


def _make(a: int, op: str, b: int, index: int) -> Problem:
    return Problem(id=index, question=f"{a}{op}{b}=", answer=str(_apply(a, op, b)), meta={"a": a, "op": op, "b": b})


def _candidate(
    index: int, attempt: int, *, split: str, digits: int, operators: Sequence[str], nonnegative: bool, seed: int
) -> tuple[int, str, int]:
    return _draw(random.Random(f"arithmetic:{seed}:{split}:{index}:{attempt}"), digits, operators, nonnegative)


def _draw_in_split(
    split: str, index: int, *, digits: int, operators: Sequence[str], nonnegative: bool, seed: int, eval_fraction: float
) -> tuple[int, str, int]:
    candidate = functools.partial(
        _candidate, split=split, digits=digits, operators=operators, nonnegative=nonnegative, seed=seed
    )
    return draw_for_split(
        split, index, seed=seed, eval_fraction=eval_fraction, candidate=candidate, key=lambda t: f"{t[0]}{t[1]}{t[2]}"
    )


def _train_item(index: int, **config) -> Problem:
    return _make(*_draw_in_split("train", index, **config), index)


def _validate(digits: int, operators: Sequence[str], eval_fraction: float, num_eval: int) -> None:
    if digits < 1:
        raise ValueError(f"digits must be >= 1, got {digits}")
    bad = [op for op in operators if op not in OPERATORS]
    if bad or not operators:
        raise ValueError(f"operators must be a non-empty subset of {OPERATORS}, got {tuple(operators)}")
    if not (0.0 < eval_fraction < 1.0):
        raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
    lo, hi = _operand_range(digits)
    space = (hi - lo + 1) ** 2 * len(set(operators))
    if num_eval > 0.5 * eval_fraction * space:  # keep dedup by rejection fast
        raise ValueError(
            f"num_eval={num_eval} is too many distinct problems for digits={digits}, operators={tuple(operators)} "
            f"(about {int(eval_fraction * space)} fall in the eval split, use at most half); "
            "lower num_eval or raise digits or eval_fraction"
        )


def generate_problems(
    split: str,
    n: int,
    *,
    digits: int = 3,
    operators: Sequence[str] = ("+",),
    nonnegative: bool = True,
    seed: int = 0,
    eval_fraction: float = 0.1,
) -> Sequence[Problem]:
    """`n` problems of `split`. Train is a lazy sequence (duplicates possible, any size is free);
    eval is materialised without duplicates, so it must fit in its share of the problem space."""
    _validate(digits, operators, eval_fraction, n if split == "eval" else 0)
    config = dict(
        digits=digits, operators=tuple(operators), nonnegative=nonnegative, seed=seed, eval_fraction=eval_fraction
    )
    if split == "train":
        return LazyProblems(n, functools.partial(_train_item, **config))
    if split != "eval":
        raise ValueError(f"unknown split {split!r}; use 'train' or 'eval'")
    seen: set[str] = set()
    problems: list[Problem] = []
    i = 0
    while len(problems) < n:
        a, op, b = _draw_in_split("eval", i, **config)
        i += 1
        if f"{a}{op}{b}" not in seen:
            seen.add(f"{a}{op}{b}")
            problems.append(_make(a, op, b, len(problems)))
    return problems


def arithmetic_reward(completion: str, answer: str) -> tuple[float, RewardStatus]:
    """1 if the completion (text before the stop token) is exactly the answer, spaces ignored."""
    text = completion.replace(" ", "").strip()
    if not text:
        return 0.0, RewardStatus.NO_ANSWER
    return (1.0, RewardStatus.OK) if text == answer else (0.0, RewardStatus.WRONG)


def _question(problem: Problem) -> str:
    return problem.question


def arithmetic_task(
    *,
    digits: int = 3,
    operators: Sequence[str] = ("+",),
    nonnegative: bool = True,
    seed: int = 0,
    num_train: int = 1_000_000,
    num_eval: int = 500,
    eval_fraction: float = 0.1,
) -> Task:
    """Generated `a op b =` problems; the completion must be the result, then the stop token."""
    config = dict(
        digits=digits, operators=tuple(operators), nonnegative=nonnegative, seed=seed, eval_fraction=eval_fraction
    )
    _validate(digits, operators, eval_fraction, num_eval)  # fail at configuration, not at first load
    sizes = {"train": num_train, "eval": num_eval}
    return Task(
        name="arithmetic",
        load_fn=functools.partial(_load, sizes=sizes, config=config),
        prompt_fn=_question,
        reward_fn=arithmetic_reward,
        cheap_reward=True,
    )


def _load(split: str, *, sizes: dict[str, int], config: dict) -> Sequence[Problem]:
    return generate_problems(split, sizes[split], **config)


def build_char_tokenizer(directory: str | os.PathLike | None = None, *, model_max_length: int = 512):
    """A character-level HF tokenizer for arithmetic (pad=0, bos=1, eos=2, unk=3), built offline.

    Encoding prepends <bos>; decoding concatenates characters. With `directory`, it is saved there
    with `save_pretrained`, so `AutoTokenizer.from_pretrained(directory)` loads it back.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(CHAR_VOCAB)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        padding_side="left",
        model_max_length=model_max_length,
    )
    if directory is not None:
        tokenizer.save_pretrained(os.fspath(directory))
    return tokenizer
