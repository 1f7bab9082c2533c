"""What a process pays before its first step: imports and the launcher's preflight.

    python experiments/benchmarks/startup.py [--repeats 5] [--python PYTHON] [--only NAME ...] [--json PATH]

Every role of a run (trainer, searchers, evaluator) is its own process and imports jax before
anything else, and the launcher checks the run (checkpoint headers, tokenizer, objective and its
options, task) before it starts any of them. On a small CPU those seconds are a large share of
a short run and of the default test run, which starts ~30 runs. Each row is a fresh interpreter
(`python -c ...`, best of --repeats wall times); the reference is the same interpreter doing
nothing (`pass`), measured in the same run, and `x_python` is each row over it.

--python measures another interpreter (e.g. a venv with other ml_dtypes / numpy versions);
--only restricts the rows (numpy and ml_dtypes need nothing of tbajax).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(Path(__file__).resolve().parent), str(ROOT)]

from common import machine, machine_line, print_table, write_json  # noqa: E402

PREFLIGHT = ("from tbajax.main import build_parser, resolve_config; from tbajax.system.launcher import preflight; "
             "preflight(resolve_config(build_parser().parse_args(['--experiment=tiny_arithmetic'])))")
ROWS = {  # name -> (code, what it is)
    "python": ("pass", "the interpreter alone (the reference)"),
    "numpy": ("import numpy", "numpy"),
    "ml_dtypes": ("import numpy, ml_dtypes", "numpy + ml_dtypes (bf16 and friends; jax imports it)"),
    "jax": ("import jax", "jax (with numpy, ml_dtypes, jaxlib)"),
    "trainer_module": ("import tbajax.system.trainer", "everything a trainer process imports before its first step"),
    "searcher_module": ("import tbajax.system.searcher", "everything a searcher process imports"),
    "launcher_preflight": (PREFLIGHT, "the launcher's checks of tiny_arithmetic before any role starts"),
}


def best_wall(python: str, code: str, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run([python, "-c", code], check=True, cwd=ROOT, capture_output=True)
        best = min(best, time.perf_counter() - t0)
    return best


def versions(python: str) -> dict[str, str]:
    code = ("import importlib.metadata as m\n"
            "for n in ('numpy', 'ml_dtypes', 'jax', 'jaxlib'):\n"
            "    try: print(n, m.version(n))\n"
            "    except m.PackageNotFoundError: print(n, '-')")
    out = subprocess.run([python, "-c", code], check=True, capture_output=True, text=True).stdout
    return dict(line.split() for line in out.splitlines())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--only", nargs="*", choices=sorted(ROWS), default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    names = ["python", *[n for n in ROWS if n != "python" and (args.only is None or n in args.only)]]
    info = machine()
    ref = best_wall(args.python, ROWS["python"][0], args.repeats)
    rows = []
    for name in names:
        s = ref if name == "python" else best_wall(args.python, ROWS[name][0], args.repeats)
        rows.append({"row": name, "seconds": s, "x_python": s / ref, "what": ROWS[name][1]})
    found = versions(args.python)
    print(machine_line(info))
    print(f"interpreter {args.python}: " + ", ".join(f"{k} {v}" for k, v in found.items()))
    print_table(rows, ["row", "seconds", "x_python", "what"])
    command = "python experiments/benchmarks/startup.py " + " ".join(sys.argv[1:])
    write_json(args.json, {"benchmark": f"startup (ml_dtypes {found.get('ml_dtypes')})", "command": command.strip(),
                           "versions": found, "repeats": args.repeats, "rows": rows, "machine": info})


if __name__ == "__main__":
    main()
