"""The responses' texts decoded in a child process, for ``reward.overlap`` (``advantage.HostResponses``).

With ``reward.overlap`` the host scores the responses inside the update's first loss, while the device runs that
micro-batch's forward. At the 0.5B GRPO benchmark (512 responses x 512 tokens, H100) the scoring took ~55-65 ms,
most of it detokenising, and the device sat idle for 24-33 ms after the forward (session 32's device-only
profiles). A thread beside the launches was measured slower (session 32, call 3): its Python work (the token
lists, the Rust tokenizer's argument conversion) holds the interpreter lock while the main thread launches the
first micro-batch. Here a child process decodes from the end of generation on; the main thread writes the live
token ids to its stdin (int32 bytes) and later reads the texts back (UTF-8 bytes with their sizes): no pickle,
a few milliseconds of the main thread's time.

The child runs ``tokenizers`` only, on the Rust tokenizer's own JSON (``Tokenizer.to_str``), and only for a
tokenizer whose Rust ``decode_batch`` gave transformers' strings in ``advantage.batch_decode``'s check. It exits
when its stdin closes (this process ended or ``close``) or this process is gone; it runs in its own session, so a
Ctrl-C reaches the trainer only. One job is in flight at a time. A child that dies or answers short is reported
in a warning and the caller decodes in-process from then on. Before it serves, its answer for the first batch
(decoded in-process too) must equal that decode (``advantage._start_process``).
"""

from __future__ import annotations

import atexit
import os
import struct
import subprocess
import sys
import warnings

import numpy as np

_CHILD = r"""
import sys
sys.path = [p for p in sys.path if p not in ("", ".")]  # python -c puts the working directory first
import array, os, struct, threading, time
from tokenizers import Tokenizer
parent = int(sys.argv[1])
def orphaned():  # stdin may stay open in a forked grandchild of the parent (an async checkpoint writer)
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)
threading.Thread(target=orphaned, daemon=True).start()
inp, out = sys.stdin.buffer, sys.stdout.buffer
def read(n):
    b = inp.read(n)
    if len(b) != n:
        raise SystemExit(0)
    return b
(size,) = struct.unpack("<Q", read(8))
tok = Tokenizer.from_str(read(size).decode("utf-8"))
while True:
    rows, total = struct.unpack("<QQ", read(16))
    lens = array.array("i"); lens.frombytes(read(4 * rows))
    ids = array.array("i"); ids.frombytes(read(4 * total))
    seqs, at = [], 0
    for n in lens:
        seqs.append(ids[at:at + n].tolist()); at += n
    texts = [t.encode("utf-8") for t in tok.decode_batch(seqs, skip_special_tokens=True)]
    out.write(array.array("Q", [len(t) for t in texts]).tobytes()); out.write(b"".join(texts)); out.flush()
"""


def _threads() -> int:
    """The child's Rust threads: the cores this process may use, shared by the node's ranks, at most 8."""
    local = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(8, cores // max(1, int(local or 1)) - 1))


class DecodeProcess:
    """A child process decoding token ids with one Rust tokenizer (``submit``, then ``texts``). Raises where the
    tokenizer cannot be written as JSON (one with Python parts) or the child cannot start."""

    def __init__(self, rust_tokenizer):
        spec = rust_tokenizer.to_str().encode("utf-8")  # before the child starts: this is what may raise
        env = dict(os.environ, TOKENIZERS_PARALLELISM="true", RAYON_NUM_THREADS=str(_threads()))
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(os.getpid())], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            env=env, start_new_session=True,  # a Ctrl-C goes to the trainer, which closes the child itself
        )  # fmt: skip
        atexit.register(self.close)
        self._job = 0  # jobs submitted; the one in flight is number ``_job`` while ``_rows`` is set
        self._rows: int | None = None  # the job in flight: its row count
        self.dead: str | None = None
        self._write(struct.pack("<Q", len(spec)) + spec)

    def _write(self, data: bytes) -> None:
        try:
            self._proc.stdin.write(data)
            self._proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError) as err:
            self._fail(f"the child did not take its input ({type(err).__name__}: {err})")

    def _read(self, n: int) -> bytes | None:
        try:
            data = self._proc.stdout.read(n) if n else b""
        except (OSError, ValueError) as err:
            data = b""
            self._fail(f"reading the child's answer failed ({type(err).__name__}: {err})")
        if len(data) != n:
            self._fail(f"the child answered {len(data)} of {n} bytes (exit code {self._proc.poll()})")
            return None
        return data

    def _fail(self, why: str) -> None:
        if self.dead is None:
            self.dead = why
            warnings.warn(
                f"The detokenising process stopped: {why}; the texts are decoded in-process.", stacklevel=3
            )
        self.close()

    def submit(self, lens: np.ndarray, ids: np.ndarray) -> int | None:
        """Starts decoding ``ids`` [B, R] (each row's first ``lens`` [B] tokens). Returns its job number for
        ``texts``, or None where the child is gone."""
        if self._rows is not None:  # a job whose texts were never read (a step that failed): drain it first
            self.texts(self._job)
        if self.dead is not None:
            return None
        lens = np.asarray(lens, dtype=np.int64).clip(0, ids.shape[1])
        live = ids[np.arange(ids.shape[1])[None, :] < lens[:, None]].astype(np.int32)
        self._write(
            struct.pack("<QQ", len(lens), live.size) + lens.astype(np.int32).tobytes() + live.tobytes()
        )
        if self.dead is not None:
            return None
        self._job += 1
        self._rows = len(lens)
        return self._job

    def texts(self, job: int | None) -> list[str] | None:
        """Job ``job``'s texts. None where the child failed (the caller decodes in-process), or where a later
        job replaced this one (its answer was drained)."""
        if job is None or job != self._job or self._rows is None:
            return None
        rows, self._rows = self._rows, None
        if self.dead is not None:
            return None
        head = self._read(8 * rows)
        sizes = np.frombuffer(head, dtype=np.uint64) if head is not None else None
        blob = self._read(int(sizes.sum())) if sizes is not None else None
        if blob is None:
            return None
        ends = np.cumsum(sizes).tolist()
        return [blob[a:b].decode("utf-8") for a, b in zip([0] + ends[:-1], ends)]

    def close(self) -> None:
        """Ends the child: its stdout closed first (a child blocked writing an unread answer then fails), then
        its stdin (it exits at the end of its input); killed where it has not exited within 5 s."""
        proc = self._proc
        for stream in (proc.stdout, proc.stdin):
            try:
                stream.close()
            except (OSError, ValueError):
                pass
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
