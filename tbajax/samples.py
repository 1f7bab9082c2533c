"""What a run's searchers generated, as text: the newest trajectories of its stores, decoded with
the run's tokenizer, with their rewards, grading status and policy versions.

    python -m tbajax.samples RUN_DIR [-n 10] [--searcher I] [--version V] [--min-reward R]
                             [--max-reward R] [--status ok|wrong|no_answer|timeout|error] [--json]

For reading what the policy does while a run goes on or after it (reward hacking, formats,
lengths): it only reads the trajectory stores, as the trainer does, so it may run beside a live
run. `--json` prints one JSON object a line (for jq and notebooks).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

# rows a store's first read takes from its end; each further read twice as many, up to READ_CHUNK
# (a few samples cost a small read; a filter that few rows pass, a few large ones)
FIRST_READ = 64
READ_CHUNK = 4096


@dataclasses.dataclass(frozen=True)
class Sample:
    searcher: int
    row: int
    version: int
    reward: float
    status: str
    finished: bool
    prompt: str
    response: str
    response_tokens: int
    wall_time: float


def newest_trajectories(run_url: str, searcher: int | None = None,
                        keep: Callable[[Any], bool] = lambda t: True) -> Iterator[tuple[int, int, Any]]:
    """(searcher id, row, trajectory) of every stored trajectory that `keep` accepts, newest first
    (by generation time across stores), read from each store's end in growing chunks."""
    from tbajax.stores import TrajectoryReader, discover_searcher_stores

    stores = discover_searcher_stores(run_url)
    if not stores:
        raise LookupError(f"no trajectories are stored under {run_url} yet: searchers append theirs after "
                          "their first scored batch")
    if searcher is not None:
        if searcher not in stores:
            raise LookupError(f"no trajectory store of searcher {searcher} under {run_url}; "
                              f"there are {sorted(stores)}")
        stores = {searcher: stores[searcher]}
    readers = {i: TrajectoryReader(url) for i, url in stores.items()}
    ends = {i: r.committed_rows() for i, r in readers.items()}
    pending: dict[int, list[tuple[int, Any]]] = {i: [] for i in readers}
    chunk = {i: min(FIRST_READ, READ_CHUNK) for i in readers}

    def refill(i: int) -> None:
        start = max(0, ends[i] - chunk[i])
        chunk[i] = min(2 * chunk[i], READ_CHUNK)
        rows = readers[i].read(start, ends[i])
        pending[i] = [(start + k, t) for k, t in enumerate(rows)]  # oldest first: pop() is the newest
        ends[i] = start

    while True:
        for i in readers:
            if not pending[i] and ends[i] > 0:
                refill(i)
        heads = [(pending[i][-1][1].wall_time, i) for i in readers if pending[i]]
        if not heads:
            return
        _, i = max(heads)
        row, t = pending[i].pop()
        if keep(t):
            yield i, row, t


def matches(t: Any, *, version: int | None = None, min_reward: float | None = None,
            max_reward: float | None = None, status: str | None = None) -> bool:
    """Whether trajectory `t` passes the command line's filters (None: any)."""
    return ((version is None or t.policy_version == version)
            and (min_reward is None or t.reward >= min_reward)
            and (max_reward is None or t.reward <= max_reward)
            and (status is None or t.reward_status.name.lower() == status))


def read_samples(run_dir: str | os.PathLike[str], n: int = 10, *, searcher: int | None = None,
                 store_url: str | None = None, **filters: Any) -> list[Sample]:
    """The newest `n` samples of the run in `run_dir` that pass `filters` (see `matches`),
    decoded as the searchers decode them for grading."""
    import itertools

    from tbajax.system import rundir
    from tbajax.system.assets import load_tokenizer_for
    from tbajax.system.run_model import with_run_tokenizer

    run_dir = Path(run_dir)
    config = with_run_tokenizer(run_dir, rundir.load_config(run_dir))
    tokenizer = load_tokenizer_for(config)
    found = itertools.islice(newest_trajectories(store_url or str(run_dir), searcher,
                                                 lambda t: matches(t, **filters)), n)
    return [Sample(i, row, t.policy_version, float(t.reward), t.reward_status.name.lower(), bool(t.finished),
                   tokenizer.decode(t.prompt_tokens, skip_special_tokens=True),
                   tokenizer.decode(t.response_tokens, skip_special_tokens=True),
                   len(t.response_tokens), float(t.wall_time))
            for i, row, t in found]


def show(samples: Sequence[Sample]) -> str:
    lines = []
    for s in samples:
        end = "finished" if s.finished else "cut at max_new_tokens"
        lines += [f"searcher {s.searcher} row {s.row} · version {s.version} · reward {s.reward:.3f} "
                  f"({s.status}) · {s.response_tokens} tokens, {end}",
                  f"  prompt:   {s.prompt!r}", f"  response: {s.response!r}", ""]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m tbajax.samples", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", type=Path, help="the run directory (--run-dir of python -m tbajax.main)")
    ap.add_argument("-n", type=int, default=10, help="how many samples, newest first (default 10)")
    ap.add_argument("--searcher", type=int, help="only this searcher's")
    ap.add_argument("--version", type=int, help="only those sampled with this param version")
    ap.add_argument("--min-reward", type=float)
    ap.add_argument("--max-reward", type=float)
    ap.add_argument("--status", choices=["ok", "wrong", "no_answer", "timeout", "error"],
                    help="only those graded so (timeout / error: the grader failed)")
    ap.add_argument("--store", help="URL of the run's stores where they are not the run dir (main's --store)")
    ap.add_argument("--json", action="store_true", help="one JSON object a line")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from tbajax.config import ConfigError
    from tbajax.models import CheckpointError

    if args.n < 1:
        print(f"error: -n must be >= 1, got {args.n}", file=sys.stderr)
        return 2
    try:
        samples = read_samples(args.run_dir, args.n, searcher=args.searcher, store_url=args.store,
                               version=args.version, min_reward=args.min_reward, max_reward=args.max_reward,
                               status=args.status)
    except (ConfigError, CheckpointError, LookupError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print("\n".join(json.dumps(dataclasses.asdict(s)) for s in samples))
    else:
        print(show(samples) if samples else "no samples match")
    return 0


if __name__ == "__main__":
    sys.exit(main())
