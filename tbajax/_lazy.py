"""Lazy package exports (PEP 562): `from tbajax.models import CausalLM` imports the submodule that
defines it on first use. Config dataclasses live in jax-free modules, so the launcher and other
processes that only read a config (a ~4 s jax + flax import on a small CPU) never import jax."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """(__getattr__, __dir__, __all__) for `package` whose public names are `{name: submodule}`
    (relative to the package, or an absolute "tbajax...." module)."""
    names = sorted(exports)

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module if module.startswith("tbajax.") else f"{package}.{module}"), name)
        importlib.import_module(package).__dict__[name] = value  # later lookups skip this function
        return value

    def __dir__() -> list[str]:
        return names

    return __getattr__, __dir__, names
