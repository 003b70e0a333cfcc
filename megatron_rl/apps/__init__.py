"""Applications on top of the library: the work behind each `megatron-rl <command>` other than training.

The library packages (rollout, models, checkpoint, rewards...) know nothing of command lines; the thin
Hydra/argparse entry points (``megatron_rl/generate.py``, ``score.py``, ``ckpt.py``, ``report.py``) convert
their arguments and call the functions here.
"""
