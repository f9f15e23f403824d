"""Compile kernels for sm_90 on a machine without a GPU (Triton's bundled ptxas), to catch errors before a GPU run."""

import itertools
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from exl3moe.kernels import trellis_matmul

TARGET = GPUTarget("cuda", 90, 32)


def compile_one(fn, signature, constexprs, num_warps=4, num_stages=3):
    sig = dict(signature)
    sig.update({name: "constexpr" for name in constexprs})
    kernel = triton.compile(ASTSource(fn, sig, constexprs), target=TARGET,
                            options={"num_warps": num_warps, "num_stages": num_stages})
    return kernel


MATMUL_SIG = {"xh_ptr": "*fp16", "words_ptr": "*i32", "part_ptr": "*fp32", "rows": "i32", "n": "i32", "tiles_n": "i32",
              "chunks_per_split": "i32", "chunks_total": "i32", "stride_x": "i32"}


def check_matmul(bn=128, bk=64, bm=64, warps=4):
    failures = 0
    for k2, cb in itertools.product([2, 3, 4, 5, 6, 8, 16], [0, 1, 2]):
        if k2 % 2 and cb != 2:
            continue
        wpad = triton.next_power_of_2(bn // 16 * 4 * k2)
        consts = {"K2": k2, "CODEBOOK": cb, "BM": bm, "BN": bn, "BK": bk, "USE_ASM": 2, "DENSE": False, "WPAD": wpad}
        try:
            kern = compile_one(trellis_matmul._trellis_matmul_kernel, MATMUL_SIG, consts, warps)
            print(f"matmul K2={k2} cb={cb} ok shared={kern.metadata.shared}")
        except Exception as e:  # noqa: BLE001
            failures += 1
            print(f"matmul K2={k2} cb={cb} FAILED: {str(e)[-1500:]}")
    return failures


if __name__ == "__main__":
    sys.exit(1 if check_matmul() else 0)
