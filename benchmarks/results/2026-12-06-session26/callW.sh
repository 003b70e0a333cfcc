#!/usr/bin/env bash
# Session 26, fourth call (on call V's machine, still warm): the sampler's tile at 64-256 rows.
mkdir -p $OUT/cW; timeout 110 python3 benchmarks/bench_sampler.py --rows 64,128,256 --key-sets 2 --out $OUT/cW/sampler_small.json > $OUT/cW/sampler_small.log 2>&1; echo rc=$?
