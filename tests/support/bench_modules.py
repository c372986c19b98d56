"""Load a script of ``bench/`` as a module, for tests that reuse a bench's model.

Benches are scripts, not a package: each imports its siblings by their plain names
(``from planner_model import ...``), which works when the script runs because its own
folder is ``sys.path[0]``. Here each sibling a bench needs is loaded first, by path,
under that plain name, so the import finds it in ``sys.modules`` and ``sys.path`` is
left as it is.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[2] / "bench"


def load_bench(name: str, *needs: str) -> ModuleType:
    """``bench/<name>.py`` as module ``name``, after each of ``needs`` (siblings it
    imports) the same way. A module loaded before is returned as it is."""
    for dep in needs:
        load_bench(dep)
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None, f"no bench/{name}.py"
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
