"""Load a user's reward function from a Python file (verl's ``custom_reward_function``).

The function has verl's signature ``compute_score(data_source, solution_str, ground_truth,
extra_info=None)`` and returns a float, or a dict with a ``score`` key whose other keys become metrics.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from pathlib import Path

from megatron_rl.config.user_code import import_user_file

PATH_KEY = "reward.custom_reward_function.path"
NAME_KEY = "reward.custom_reward_function.name"


def load_custom_reward_fn(
    path: str | Path | None, name: str = "compute_score", reward_kwargs: dict | None = None
) -> Callable:
    """Import ``path`` as a module and return its function ``name`` (with ``reward_kwargs`` bound)."""
    if not path:
        raise ValueError(f"reward.reward_fn=custom needs {PATH_KEY}: set it to a .py file defining {name}()")
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise FileNotFoundError(f"{PATH_KEY}='{path}' does not exist; set it to a .py file defining {name}()")
    module = import_user_file(file, PATH_KEY)
    fn = getattr(module, name, None)
    if fn is None:
        found = sorted(k for k, v in vars(module).items() if inspect.isfunction(v) and not k.startswith("_"))
        raise AttributeError(
            f"'{file}' ({PATH_KEY}) defines no '{name}'; functions found: {found}; set {NAME_KEY} to one of them"
        )
    if not callable(fn):
        raise TypeError(f"{NAME_KEY}='{name}' in '{file}' is a {type(fn).__name__}, not a function")
    return functools.partial(fn, **reward_kwargs) if reward_kwargs else fn


def describe_fn(fn: Callable) -> str:
    """``file:qualname`` of a (possibly partial) function, for error messages."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    code = getattr(fn, "__code__", None)
    qualname = getattr(fn, "__qualname__", type(fn).__name__)
    return f"{code.co_filename}:{qualname}" if code is not None else qualname
