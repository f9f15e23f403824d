"""Compile the Triton MoE expert kernels for sm_90 without a GPU (Triton's bundled ptxas); print register use."""

import os
import subprocess
import tempfile

os.environ.pop("TRITON_INTERPRET", None)
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from exl3moe.kernels.moe_experts import moe_down_kernel, moe_gate_up_finish_kernel, moe_gate_up_kernel  # noqa: E402
from exl3moe.kernels.moe_intermediate import moe_intermediate_kernel  # noqa: E402

CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def build(fn, types, constexprs, num_warps):
    sig = {n: ("constexpr" if n in constexprs else types.get(n, "i32")) for n in fn.arg_names}
    kernel = triton.compile(ASTSource(fn, sig, constexprs), target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=num_warps))
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as fh:
        fh.write(kernel.asm["cubin"])
    usage = subprocess.run([CUOBJDUMP, "-res-usage", fh.name], capture_output=True, text=True).stdout
    print(fn.fn.__name__, constexprs.get("KSPLIT"), [line.strip()[:40] for line in usage.splitlines() if "REG" in line])


P = lambda t: "*" + t  # noqa: E731
GATE_UP = dict(hidden_ptr=P("fp16"), token_scale_ptr=P("fp32"), h32_ptr=P("fp32"), block_expert_ptr=P("i32"),
               block_start_ptr=P("i32"),
               offsets_ptr=P("i32"), sorted_slots_ptr=P("i32"), trellis_addr_ptr=P("i64"), suh_addr_ptr=P("i64"),
               svh_addr_ptr=P("i64"), k2_ptr=P("i32"), codebook_ptr=P("i32"), stage_addr_ptr=P("i64"),
               stage_k2_ptr=P("i32"), stage_codebook_ptr=P("i32"), stage_scale_ptr=P("fp32"), bias_ptr=P("fp32"),
               limit="fp32", partial_ptr=P("fp32"))
for ksplit in (1, 16):
    build(moe_gate_up_kernel, GATE_UP, dict(ROUTED=True, GATED=True, ACTIVATION=0, HAS_LIMIT=False, HAS_BIAS=False,
                                            NUM_STAGES=0, BM=16, DK=32, WPAD=512, USE_ASM=True, SPLIT_BF16=True,
                                            KSPLIT=ksplit), 8)
FINISH = dict(partial_ptr=P("fp32"), token_scale_ptr=P("fp32"), h32_ptr=P("fp32"), block_expert_ptr=P("i32"),
              block_start_ptr=P("i32"),
              offsets_ptr=P("i32"), sorted_slots_ptr=P("i32"), svh_addr_ptr=P("i64"), suh_addr_ptr=P("i64"),
              bias_ptr=P("fp32"), limit="fp32")
for gated in (True, False):
    build(moe_gate_up_finish_kernel, FINISH, dict(GATED=gated, ACTIVATION=0 if gated else 2, HAS_LIMIT=True,
                                                  HAS_BIAS=True, BM=16, KSPLIT=8, SPLIT_BF16=True), 8)
DOWN = dict(h_rot_ptr=P("fp16"), h_scale_ptr=P("fp32"), y_ptr=P("fp32"), block_expert_ptr=P("i32"),
            block_start_ptr=P("i32"), offsets_ptr=P("i32"), sorted_slots_ptr=P("i32"), trellis_addr_ptr=P("i64"),
            svh_addr_ptr=P("i64"), k2_ptr=P("i32"), codebook_ptr=P("i32"), stage_addr_ptr=P("i64"),
            stage_k2_ptr=P("i32"), stage_codebook_ptr=P("i32"), stage_scale_ptr=P("fp32"), bias_ptr=P("fp32"))
build(moe_down_kernel, DOWN, dict(ROUTED=True, HAS_BIAS=False, NUM_STAGES=0, BM=16, DK=32, WPAD=512, USE_ASM=True,
                                  SPLIT_BF16=True), 8)
INTERMEDIATE = dict(h32_ptr=P("fp32"), h_rot_ptr=P("fp16"), h_scale_ptr=P("fp32"), block_expert_ptr=P("i32"),
                    block_start_ptr=P("i32"), offsets_ptr=P("i32"), sorted_slots_ptr=P("i32"))
build(moe_intermediate_kernel, INTERMEDIATE, dict(ROUTED=True, BM=16, LOW=-6, HIGH=11, TARGET=7, MAX_E=126), 4)
