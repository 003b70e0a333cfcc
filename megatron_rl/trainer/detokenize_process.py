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
when its stdin closes (this process ended or ``close``). One job is in flight at a time. A child that dies or
answers short is reported in a warning and the caller decodes in-process from then on.
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
import array, struct, sys
from tokenizers import Tokenizer
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
    """The child's Rust threads: this machine's cores shared by the node's ranks, at most 8."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return max(1, min(8, (os.cpu_count() or 1) // max(1, local) - 1))


class DecodeProcess:
    """A child process decoding token ids with one Rust tokenizer (``submit``, then ``texts``)."""

    def __init__(self, rust_tokenizer):
        env = dict(os.environ, TOKENIZERS_PARALLELISM="true", RAYON_NUM_THREADS=str(_threads()))
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
        )
        self._rows: int | None = None  # the job in flight: its row count
        self.dead: str | None = None
        spec = rust_tokenizer.to_str().encode("utf-8")
        self._write(struct.pack("<Q", len(spec)) + spec)
        atexit.register(self.close)

    def _write(self, data: bytes) -> None:
        try:
            self._proc.stdin.write(data)
            self._proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError) as err:
            self._fail(f"the child did not take its input ({type(err).__name__}: {err})")

    def _read(self, n: int) -> bytes | None:
        data = self._proc.stdout.read(n) if n else b""
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

    def submit(self, lens: np.ndarray, ids: np.ndarray) -> bool:
        """Starts decoding ``ids`` [B, R] (each row's first ``lens`` [B] tokens). False where the child is gone."""
        if self._rows is not None:  # a job whose texts were never read (a step that failed): drain it first
            self.texts()
        if self.dead is not None:
            return False
        lens = np.asarray(lens, dtype=np.int64).clip(0, ids.shape[1])
        live = ids[np.arange(ids.shape[1])[None, :] < lens[:, None]].astype(np.int32)
        self._write(
            struct.pack("<QQ", len(lens), live.size) + lens.astype(np.int32).tobytes() + live.tobytes()
        )
        self._rows = len(lens) if self.dead is None else None
        return self.dead is None

    def texts(self) -> list[str] | None:
        """The submitted job's texts (None where the child failed: the caller decodes in-process)."""
        rows, self._rows = self._rows, None
        if rows is None or self.dead is not None:
            return None
        head = self._read(8 * rows)
        sizes = np.frombuffer(head, dtype=np.uint64) if head is not None else None
        blob = self._read(int(sizes.sum())) if sizes is not None else None
        if blob is None:
            return None
        ends = np.cumsum(sizes).tolist()
        return [blob[a:b].decode("utf-8") for a, b in zip([0] + ends[:-1], ends)]

    def close(self) -> None:
        proc = self._proc
        if proc.poll() is None:
            try:
                proc.stdin.close()
                proc.wait(timeout=5)
            except (OSError, ValueError, subprocess.TimeoutExpired):
                proc.kill()
