"""The decode-attention, RMSNorm-backward and SwiGLU-backward Triton kernels (the ones session 19 wrote or
changed; not yet the log-prob, sampler, fused-decode and exact-mode kernels) compiled for an H100/H200 (sm_90)
on this CPU machine, without the launch-time specialisation on integers divisible by 16: Triton's code generator and
ptxas run without a GPU. The other kernel tests run under Triton's interpreter, which accepts programs the
compiler refuses (session 19: a loop bound typed int32 in one branch and int64 in the other passed every
interpreter test and failed to compile on the H200). Runs in a subprocess: the test process sets
TRITON_INTERPRET=1, under which ``triton.jit`` kernels cannot be compiled."""

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton", reason="triton is in the dev extras")

SCRIPT = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from megatron_rl.kernels import decode_attention, rmsnorm, swiglu

    def build(fn, types, constexprs, **options):
        sig = dict(types) | {k: "constexpr" for k in constexprs}
        src = ASTSource(fn=fn, signature=sig, constexprs=constexprs)
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
        assert "ptx" in kernel.asm and kernel.asm["ptx"], fn
        return kernel

    bf, i32 = "*bf16", "i32"
    attn = {"q_ptr": bf, "k_ptr": bf, "v_ptr": bf, "pos_ptr": "*i64", "lead_ptr": "*i64", "plen_ptr": "*i64",
            "out_ptr": bf, "scale": "fp32"}
    attn |= {n: i32 for n in ("sq_b", "sq_g", "sq_r", "sk_b", "sk_g", "sk_t", "sv_b", "sv_g", "sv_t", "so_b",
                              "so_g", "so_r")}
    for shared in (False, True):  # Qwen2.5-0.5B's decode shape: 2 KV groups of 7 query heads, D = 64
        build(decode_attention._decode_attention_kernel, attn,
              {"groups": 2, "rep": 7, "rows": 16, "dim": 64, "block": 64, "shared": shared}, num_warps=4)
    norm = {"x_ptr": bf, "dy_ptr": bf, "w_ptr": bf, "dx_ptr": bf, "dw_ptr": "*fp32", "rows": i32, "hidden": i32,
            "stride_x": i32, "stride_dy": i32, "stride_dx": i32, "eps": "fp32", "rows_per": i32}
    for tile, block in ((4, 1024), (1, 4096)):
        build(rmsnorm._backward_kernel, norm, {"tile": tile, "block": block}, num_warps=8)
    glu = {"y_ptr": bf, "g_ptr": bf, "dy_ptr": bf, "rows": i32, "ffn": i32, "stride_y": i32, "stride_g": i32,
           "stride_dy": i32}
    build(swiglu._backward_kernel, glu, {"block_rows": 8, "block_cols": 256}, num_warps=4)
    print("compiled")
    """
)


def test_decode_attention_rmsnorm_and_swiglu_kernels_compile_for_sm90():
    env = dict(os.environ, TRITON_INTERPRET="0")
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "compiled" in out.stdout, out.stderr[-3000:]
