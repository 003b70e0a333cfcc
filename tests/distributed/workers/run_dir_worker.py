"""torchrun worker (world 4): every rank resolves the same run directory although the ranks' clocks read
different seconds (rank r starts 0.7 r s later, as ranks of a launch that straddles a second boundary)."""

from __future__ import annotations

import contextlib
import io
import os
import sys
import time

rank = int(os.environ["RANK"])
time.sleep(0.7 * rank)
# Hydra's run dir is trainer.output_dir's default (${hydra:runtime.output_dir}); --cfg prints it resolved
sys.argv = ["megatron-rl train", "--cfg", "hydra", "--resolve", "--package", "hydra.run"]
from megatron_rl.train import main  # noqa: E402

buffer = io.StringIO()
with contextlib.redirect_stdout(buffer), contextlib.suppress(SystemExit):
    main()
lines = [line for line in buffer.getvalue().splitlines() if line.strip().startswith("dir:")]
assert len(lines) == 1, buffer.getvalue()
print(f"rank {rank} {time.strftime('%H-%M-%S')} {lines[0].split(':', 1)[1].strip()}", flush=True)
