#!/usr/bin/env bash
# Session 28, calls E1-E4: FlashAttention-4 on the device. The wheels (flash-attn-4 4.0.0b40, nvidia-cutlass-dsl
# 4.8.1 and its cu13 libs, quack-kernels, apache-tvm-ffi, torch-c-dlpack-ext, einops; pip download from PyPI) are
# carried as .fa4a/ (with half of the 92 MB cu13 libs wheel) and, in a second call on the held machine, .fa4b/
# (the other half): the carry limit is 64 MiB a call. Each call copies what it carries to /tmp/fa4parts (kept
# while the machine is held); once both halves are there, probe_fa4.py runs.
set -u
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
P=/tmp/fa4parts; mkdir -p $P
for d in .fa4a .fa4b; do [ -d $d ] && cp $d/* $P/; done
ls $P
if [ -f $P/cu13.part_aa ] && [ -f $P/cu13.part_ab ] && [ -d .whl ]; then
  cat $P/cu13.part_aa $P/cu13.part_ab > $P/nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl $P/*.whl && export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD && echo fa4 installed
  timeout 300 python3 benchmarks/results/2026-12-06-session28/probe_fa4.py 2>&1 | tail -5 | tee "$OUT/probe_fa4.log" | cut -c1-3000
fi
