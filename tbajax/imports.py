"""Load a user's code by name: `package.module:attr` or `path/to/file.py:attr`.

The one place that turns those strings (which survive a round trip through config.json) into
objects, for objectives, tasks and experiments. A file is loaded under a module name derived
from its absolute path, registered in `sys.modules`, so pickling (reward workers re-import it
by that name) and dataclasses defined in the file work.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

USER_MODULE_PREFIX = "tbajax_user_"


def load_module(where: str) -> ModuleType:
    """A dotted module name, or a `.py` file loaded under a name derived from its path."""
    if not where.endswith(".py"):
        return importlib.import_module(where)
    path = Path(where).expanduser().resolve()
    if not path.is_file():
        raise ImportError(f"no Python file at {path}")
    name = USER_MODULE_PREFIX + re.sub(r"\W", "_", str(path.with_suffix("")))
    return sys.modules[name] if name in sys.modules else load_file_as(name, path)


def load_file_as(name: str, path: str | Path) -> ModuleType:
    """Execute a `.py` file as module `name`, registered in sys.modules (removed again on error)."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def import_object(path: str, what: str = "object") -> Any:
    """`module:attr` / `file.py:attr` -> the attribute; ValueError saying what was expected."""
    where, _, attr = path.rpartition(":")
    if not where or not attr:
        raise ValueError(f"{what} {path!r} must look like 'package.module:name' or 'path/to/file.py:name'")
    try:
        return getattr(load_module(where), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(
            f"cannot import {what} {path!r} (expected 'package.module:name' or 'path/to/file.py:name'): {e}"
        ) from e
