#!/usr/bin/env bash
# Session 37, call A (carry `.whl`): session 36's call H as it is (decode split + slot kernels A B B A, the
# 0.5B fixed step with the slot kernels off and on; on an H200 the 3B fixed step), hoping for an H200. What
# ran was a copy of callH.sh writing to $OUT/cA; this runs the original and moves its folder there.
bash benchmarks/results/2026-12-07-session36/callH.sh && mv "$OUT/cH" "$OUT/cA"
