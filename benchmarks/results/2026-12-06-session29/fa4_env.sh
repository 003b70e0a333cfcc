# Sourced by session 29's calls 2-4 after call 1: assembles and installs FlashAttention-4 (once per held machine)
# with the megatron-core wheels of `.whl`, and sets PYTHONPATH (the cutlass DSL's .pth is not read from a
# --target install, so its dsl_packages folder is added by hand).
P=/tmp/fa4parts
[ -d .fa4b ] && cp -r .fa4b/* $P/
if [ ! -f /tmp/site/.fa4_done ] && [ -f $P/cu13.part_aa ] && [ -f $P/cu13.part_ab ]; then
  cat $P/cu13.part_aa $P/cu13.part_ab > $P/nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl
  W=($P/*.whl)
  python3 -c "import cuda.bindings" 2>/dev/null || W+=($P/cb/*.whl)
  python3 -c "import google.protobuf" 2>/dev/null || W+=($P/pb/*.whl)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "${W[@]}" \
    && touch /tmp/site/.fa4_done
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD
python3 -c "from flash_attn.cute import flash_attn_varlen_func; print('flash-attn-4 imports')" 2>&1 | tail -1
