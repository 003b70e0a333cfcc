"""Built-in tasks: data, a model made in code, and the reward rule that scores them.

Their reward rules are added to the rewards registry by ``register_builtin_tasks()``, which the entry
points that score (training, ``megatron-rl score``) call; importing this package registers nothing.
"""

from __future__ import annotations

from megatron_rl.rewards.registry import register_rule
from megatron_rl.rollout.tools import TOOL_SETS
from megatron_rl.tasks import last_digit, secret_digit

BUILTIN_TASKS = (last_digit,)


def register_builtin_tasks() -> None:
    """Register each built-in task's rule under its ``REWARD_NAME`` and ``DATA_SOURCE`` (for
    ``reward.reward_fn=auto``). Calling it again is a no-op: the registry accepts the same function twice."""
    for task in BUILTIN_TASKS:
        register_rule(task.REWARD_NAME, task.compute_score, data_sources=(task.DATA_SOURCE,))
    if secret_digit.TOOL_SET not in TOOL_SETS:  # the tool-using task also brings a tool set and a parser
        secret_digit.register()
