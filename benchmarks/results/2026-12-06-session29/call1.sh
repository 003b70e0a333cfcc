#!/usr/bin/env bash
# Session 29, call 1: the first half of FlashAttention-4's wheels, kept for call 2 in /tmp/fa4parts on the held
# machine (the carry limit is 64 MiB a call). Carry `.fa4a` (54 MB of the 92 MB nvidia-cutlass-dsl-libs-cu13
# 4.8.1 wheel, flash-attn-4 4.0.0b40, nvidia-cutlass-dsl and -libs-core 4.8.1, einops, and protobuf in pb/ for a
# device without it); prints which of FA4's other requirements the device has. ~10 s.
set -u
P=/tmp/fa4parts; mkdir -p $P; cp -r .fa4a/* $P/; ls -R $P | tr '\n' ' '; echo
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 - <<'PY'
import importlib
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda)
for m in ("cuda.bindings", "google.protobuf", "typing_extensions", "einops"):
    try:
        mod = importlib.import_module(m)
        print(m, getattr(mod, "__version__", "present"))
    except Exception as e:  # noqa: BLE001
        print(m, "missing:", e)
PY
