"""Importing a user's Python file named by a config key (a custom reward function, a tool file).

One module per file: a file named by two keys (the reward file that also defines the tools) is imported
once, so what it registers is not registered twice. Import errors name the key and the file.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def import_user_file(file: Path, key: str) -> ModuleType:
    """The module of ``file`` (already resolved), importing it on first use under a name unique to its path
    (two files both called ``reward.py`` do not shadow each other)."""
    for module in list(sys.modules.values()):
        if getattr(module, "__file__", None) and Path(module.__file__).resolve() == file:
            return module
    module_name = f"megatron_rl_user_{hashlib.sha1(str(file).encode()).hexdigest()[:12]}"
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise ImportError(f"{key}='{file}' cannot be imported as a Python module; use a .py file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        sys.modules.pop(module_name, None)
        raise ImportError(f"importing {key}='{file}' failed: {type(err).__name__}: {err}") from err
    return module
