"""Grouped EXL3 expert kernels of the fused MoE, driven by device tables (layout: ops/tables.py).

Rows are the routed slots of one chunk, grouped by route_pack into route blocks of BM rows of one
expert (`ROUTED`), or simply all tokens for the shared expert (not `ROUTED`, expert 0).

gate/up kernel, grid (route block, I / 128): for each 128-wide k-chunk of the hidden size it loads the
block's token rows of x once, multiplies them by their token's power of two (row_scale.row_scales; 1 for ordinary
tokens) and by each projection's suh, rotates with the 128-Hadamard (factored as
H_{128/DK} kron H_DK: one DK-point tensor-core transform per chunk, then a signed sum per DK-wide slice)
and multiplies each slice by W_inner[slice, column block] decoded on the fly (runtime K and codebook per
expert, plus residual stages); the epilogue applies the output Hadamard, svh, the token's power of two undone,
bias, the activation (and clamp limit), then down's suh and input Hadamard, and stores fp32 rows of h32 [slot
position, I]: down's rotated input for k-chunk = this column block. moe_intermediate.py scales each complete row
by a power of two into fp16 h_rot.

down kernel, grid (route block, H / 128): h_rot rows @ decoded W_down, output Hadamard, svh, the row's power of two
undone, bias; stores fp32 unweighted rows y[slot, H] (the combine applies routing weights in slot order).

Every output row depends only on its own input row: no reduction crosses rows of a block.
"""

import torch
import triton
import triton.language as tl

from .hadamard import INV_SQRT_128, hadamard128_rows, split_bf16
from .trellis_decode import decode_words, gather_setup, interpreting, load_word_rows

# Output columns per program: the Hadamard acts on 128-column blocks, so epilogues need all of them.
BLOCK_N = tl.constexpr(128)
# Activation ids of the kernels (the ACTIVATION constexpr).
ACTIVATION_ID = {"silu": 0, "gelu": 1, "relu2": 2}
# The largest finite fp32 value: a gate of +-inf is clamped to it before the activation.
FP32_MAX = tl.constexpr(3.4028234663852886e38)
# Warps per program: at 4 warps the sm_90 build of gate/up spills registers (cuobjdump), at 8 it does not (BM 16).
NUM_WARPS = 8


@triton.jit
def _parity_sign(x):
    """(-1)^popcount(x) as fp32 for 0 <= x < 256."""
    x = x ^ (x >> 4)
    x = x ^ (x >> 2)
    x = x ^ (x >> 1)
    return (1 - 2 * (x & 1)).to(tl.float32)


@triton.jit
def _rotate_blocks(x, BM: tl.constexpr, DK: tl.constexpr, SPLIT_BF16: tl.constexpr):
    """Unnormalised DK-point Hadamard of each DK-wide block of x [BM, 128] fp32 -> [BM, 128 / DK, DK].

    Hn128 = (H_{128/DK} kron H_DK) / sqrt(128), so this is the inner factor; `_rotated_slice` applies the outer.
    """
    idx = tl.arange(0, DK)
    h = _parity_sign(idx[:, None] & idx[None, :])
    rows = tl.reshape(x, [BM * (128 // DK), DK])
    if SPLIT_BF16:
        hb = h.to(tl.bfloat16)
        hi = rows.to(tl.bfloat16)
        lo = (rows - hi.to(tl.float32)).to(tl.bfloat16)
        y = tl.dot(lo, hb, tl.dot(hi, hb))
    else:
        y = tl.dot(rows, h, input_precision="ieee")
    return tl.reshape(y, [BM, 128 // DK, DK])


@triton.jit
def _rotated_slice(blocks, SUB: tl.constexpr, DK: tl.constexpr):
    """Columns [SUB * DK, SUB * DK + DK) of x @ Hn128 from `_rotate_blocks(x)`, fp32 [BM, DK]."""
    sign = _parity_sign(tl.arange(0, 128 // DK) & SUB)
    return tl.sum(blocks * sign[None, :, None], axis=1) * INV_SQRT_128


@triton.jit
def _entry(addr_ptr, k2_ptr, codebook_ptr, index):
    """(int32 word pointer, 2K, codebook id) of one table entry."""
    words = tl.load(addr_ptr + index).to(tl.pointer_type(tl.int32))
    return words, tl.load(k2_ptr + index), tl.load(codebook_ptr + index)


@triton.jit
def _decode_block(words, k2, codebook, row0, col_block, tiles_n, DK: tl.constexpr, WPAD: tl.constexpr,
                  USE_ASM: tl.constexpr):
    """W_inner[row0 : row0 + DK, 128 col_block : + 128] as fp16, with runtime 2K and codebook."""
    # int32 word offsets: one expert weight stays far below 2**31 words (8 GB).
    first_tile = (row0 // 16) * tiles_n + col_block * (BLOCK_N // 16)
    word_rows = load_word_rows(words + first_tile * (4 * k2), tiles_n, k2, DK, BLOCK_N, WPAD)
    idx_last, idx_prev, shift = gather_setup(DK, BLOCK_N, k2, WPAD)
    flat = tl.reshape(word_rows, [(DK // 16) * WPAD])
    lo = tl.reshape(tl.gather(flat, idx_last, 0), [DK, BLOCK_N])
    hi = tl.reshape(tl.gather(flat, idx_prev, 0), [DK, BLOCK_N])
    if codebook == 0:
        w = decode_words(lo, hi, shift, 0, USE_ASM)
    elif codebook == 1:
        w = decode_words(lo, hi, shift, 1, USE_ASM)
    else:
        w = decode_words(lo, hi, shift, 2, USE_ASM)
    return w


@triton.jit
def _project(acc, x, words, k2, codebook, index, row0, col_block, tiles_n,
             stage_addr_ptr, stage_k2_ptr, stage_codebook_ptr, stage_scale_ptr, stage_stride,
             NUM_STAGES: tl.constexpr, DK: tl.constexpr, WPAD: tl.constexpr, USE_ASM: tl.constexpr):
    """acc += x [BM, DK] fp16 @ (W_inner + sum_s scale_s R_s)[row0 : row0 + DK, column block], scales in fp32."""
    acc = tl.dot(x, _decode_block(words, k2, codebook, row0, col_block, tiles_n, DK, WPAD, USE_ASM), acc)
    for s in tl.static_range(NUM_STAGES):
        scale = tl.load(stage_scale_ptr + s * stage_stride + index)
        if scale != 0.0:
            r_words, r_k2, r_codebook = _entry(stage_addr_ptr, stage_k2_ptr, stage_codebook_ptr,
                                               s * stage_stride + index)
            r = _decode_block(r_words, r_k2, r_codebook, row0, col_block, tiles_n, DK, WPAD, USE_ASM)
            # acc = scale (acc / scale + x R), in fp32 as the CUDA kernels: R stays fp16, so no scale overflows it
            acc = tl.dot(x, r, acc / scale) * scale
    return acc


@triton.jit
def _block_rows(pid_b, block_expert_ptr, block_start_ptr, offsets_ptr, sorted_slots_ptr, num_rows,
                BM: tl.constexpr, ROUTED: tl.constexpr):
    """(expert or -1, sorted positions [BM], row mask [BM], flat slots [BM]) of route block pid_b."""
    if ROUTED:
        expert = tl.load(block_expert_ptr + pid_b)
        pos = tl.load(block_start_ptr + pid_b) + tl.arange(0, BM)
        end = tl.where(expert >= 0, tl.load(offsets_ptr + tl.maximum(expert, 0) + 1), 0)
        mask = pos < end
        slot = tl.load(sorted_slots_ptr + pos, mask=mask, other=0)
    else:
        expert = pid_b * 0
        pos = pid_b * BM + tl.arange(0, BM)
        mask = pos < num_rows
        slot = pos
    return expert, pos, mask, slot


@triton.jit
def _sigmoid(x):
    """1 / (1 + exp(-x)) in fp32 without overflow: exp of -|x| only."""
    e = tl.exp(-tl.abs(x))
    return tl.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


@triton.jit
def _activate(g, u, ACTIVATION: tl.constexpr, HAS_LIMIT: tl.constexpr, limit):
    """h from gate g and up u (fp32): silu(g) u, gelu_tanh(g) u, or relu(u)^2; clamp as reference.moe."""
    if ACTIVATION == 2:
        a = tl.maximum(u, 0.0)
        if HAS_LIMIT:
            a = tl.minimum(a, limit)
        return a * a
    g = tl.minimum(tl.maximum(g, -FP32_MAX), FP32_MAX)   # an overflowed gate activates as its finite neighbour
    if ACTIVATION == 0:
        a = g * _sigmoid(g)
    else:
        # 0.5 (1 + tanh(z)) = sigmoid(2 z)
        a = g * _sigmoid(1.5957691216 * (g + 0.044715 * g * g * g))
    if HAS_LIMIT:
        a = tl.minimum(a, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    return a * u


@triton.jit
def _epilogue(acc, svh, bias_ptr, cols, unscale, HAS_BIAS: tl.constexpr, SPLIT_BF16: tl.constexpr):
    """Output Hadamard, svh, the rows' powers of two `unscale` [BM] and bias of one 128-column block (fp32)."""
    y = hadamard128_rows(acc, SPLIT_BF16) * tl.load(svh + cols).to(tl.float32)[None, :]
    y = y * unscale[:, None]
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + cols)[None, :]
    return y


@triton.jit
def moe_gate_up_kernel(
    hidden_ptr, stride_hidden, token_scale_ptr, h32_ptr,
    block_expert_ptr, block_start_ptr, offsets_ptr, sorted_slots_ptr, num_rows, top_k,
    trellis_addr_ptr, suh_addr_ptr, svh_addr_ptr, k2_ptr, codebook_ptr,
    stage_addr_ptr, stage_k2_ptr, stage_codebook_ptr, stage_scale_ptr, bias_ptr,
    num_experts, hidden_size, inter_size, limit, partial_ptr, capacity,
    ROUTED: tl.constexpr, GATED: tl.constexpr, ACTIVATION: tl.constexpr, HAS_LIMIT: tl.constexpr,
    HAS_BIAS: tl.constexpr, NUM_STAGES: tl.constexpr, BM: tl.constexpr, DK: tl.constexpr,
    WPAD: tl.constexpr, USE_ASM: tl.constexpr, SPLIT_BF16: tl.constexpr, KSPLIT: tl.constexpr,
):
    pid_b = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    expert, pos, row_mask, slot = _block_rows(pid_b, block_expert_ptr, block_start_ptr, offsets_ptr,
                                              sorted_slots_ptr, num_rows, BM, ROUTED)
    if expert >= 0:
        if ROUTED:
            token = slot // top_k
        else:
            token = slot
        x_rows = hidden_ptr + token.to(tl.int64)[:, None] * stride_hidden
        token_scale = tl.load(token_scale_ptr + token, mask=row_mask, other=1.0)
        stage_stride = 3 * num_experts
        tiles_n = inter_size // 16
        up_index = num_experts + expert
        up_words, up_k2, up_cb = _entry(trellis_addr_ptr, k2_ptr, codebook_ptr, up_index)
        up_suh = tl.load(suh_addr_ptr + up_index).to(tl.pointer_type(tl.float16))
        acc_up = tl.zeros((BM, BLOCK_N), dtype=tl.float32)
        if GATED:
            gate_words, gate_k2, gate_cb = _entry(trellis_addr_ptr, k2_ptr, codebook_ptr, expert)
            gate_suh = tl.load(suh_addr_ptr + expert).to(tl.pointer_type(tl.float16))
            acc_gate = tl.zeros((BM, BLOCK_N), dtype=tl.float32)
        chunks = hidden_size // 128
        span = tl.cdiv(chunks, KSPLIT)
        for chunk in range(pid_s * span, tl.minimum(pid_s * span + span, chunks)):
            k0 = chunk * 128
            kcols = k0 + tl.arange(0, 128)
            x = tl.load(x_rows + kcols[None, :], mask=row_mask[:, None], other=0.0).to(tl.float32)
            x = x * token_scale[:, None]
            up_blocks = _rotate_blocks(x * tl.load(up_suh + kcols).to(tl.float32)[None, :], BM, DK, SPLIT_BF16)
            if GATED:
                gate_blocks = _rotate_blocks(x * tl.load(gate_suh + kcols).to(tl.float32)[None, :], BM, DK,
                                             SPLIT_BF16)
            for sub in tl.static_range(128 // DK):
                xr = _rotated_slice(up_blocks, sub, DK).to(tl.float16)
                acc_up = _project(acc_up, xr, up_words, up_k2, up_cb, up_index, k0 + sub * DK, pid_n, tiles_n,
                                  stage_addr_ptr, stage_k2_ptr, stage_codebook_ptr, stage_scale_ptr, stage_stride,
                                  NUM_STAGES, DK, WPAD, USE_ASM)
                if GATED:
                    xr = _rotated_slice(gate_blocks, sub, DK).to(tl.float16)
                    acc_gate = _project(acc_gate, xr, gate_words, gate_k2, gate_cb, expert, k0 + sub * DK, pid_n,
                                        tiles_n, stage_addr_ptr, stage_k2_ptr, stage_codebook_ptr, stage_scale_ptr,
                                        stage_stride, NUM_STAGES, DK, WPAD, USE_ASM)
        ncols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        if not GATED:
            acc_gate = acc_up
        if KSPLIT == 1:
            _finish_rows(acc_gate, acc_up, expert, pos, row_mask, ncols, 1.0 / token_scale, h32_ptr, svh_addr_ptr,
                         suh_addr_ptr, bias_ptr, num_experts, inter_size, limit, GATED, ACTIVATION, HAS_LIMIT,
                         HAS_BIAS, SPLIT_BF16)
        else:
            part = partial_ptr + ((pid_s * 2 * capacity + pos).to(tl.int64) * inter_size)[:, None] + ncols[None, :]
            tl.store(part + capacity * inter_size, acc_up, mask=row_mask[:, None])
            if GATED:
                tl.store(part, acc_gate, mask=row_mask[:, None])


@triton.jit
def _finish_rows(acc_gate, acc_up, expert, pos, row_mask, ncols, unscale, h32_ptr, svh_addr_ptr, suh_addr_ptr,
                 bias_ptr, num_experts, inter_size, limit, GATED: tl.constexpr, ACTIVATION: tl.constexpr,
                 HAS_LIMIT: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_BF16: tl.constexpr):
    """gate/up epilogue: output Hadamards, svh, the tokens' powers of two undone (`unscale` [BM]), bias,
    activation, then down's suh and input Hadamard -> h32 (fp32)."""
    up_index = num_experts + expert
    up_svh = tl.load(svh_addr_ptr + up_index).to(tl.pointer_type(tl.float16))
    up = _epilogue(acc_up, up_svh, bias_ptr + up_index.to(tl.int64) * inter_size, ncols, unscale, HAS_BIAS,
                   SPLIT_BF16)
    if GATED:
        gate_svh = tl.load(svh_addr_ptr + expert).to(tl.pointer_type(tl.float16))
        gate = _epilogue(acc_gate, gate_svh, bias_ptr + expert.to(tl.int64) * inter_size, ncols, unscale,
                         HAS_BIAS, SPLIT_BF16)
    else:
        gate = up
    h = _activate(gate, up, ACTIVATION, HAS_LIMIT, limit)
    down_suh = tl.load(suh_addr_ptr + 2 * num_experts + expert).to(tl.pointer_type(tl.float16))
    h = hadamard128_rows(h * tl.load(down_suh + ncols).to(tl.float32)[None, :], SPLIT_BF16)
    out = h32_ptr + pos.to(tl.int64)[:, None] * inter_size + ncols[None, :]
    tl.store(out, h, mask=row_mask[:, None])


@triton.jit
def moe_gate_up_finish_kernel(
    partial_ptr, capacity, token_scale_ptr, top_k, h32_ptr, block_expert_ptr, block_start_ptr, offsets_ptr,
    sorted_slots_ptr,
    svh_addr_ptr, suh_addr_ptr, bias_ptr, num_experts, inter_size, limit,
    GATED: tl.constexpr, ACTIVATION: tl.constexpr, HAS_LIMIT: tl.constexpr, HAS_BIAS: tl.constexpr,
    BM: tl.constexpr, KSPLIT: tl.constexpr, SPLIT_BF16: tl.constexpr,
):
    """Sum the KSPLIT gate/up partial accumulators in split order, then the gate/up epilogue."""
    pid_b = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert, pos, row_mask, slot = _block_rows(pid_b, block_expert_ptr, block_start_ptr, offsets_ptr,
                                              sorted_slots_ptr, 0, BM, True)
    if expert >= 0:
        ncols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs = (pos.to(tl.int64) * inter_size)[:, None] + ncols[None, :]
        acc_up = tl.zeros((BM, BLOCK_N), dtype=tl.float32)
        acc_gate = tl.zeros((BM, BLOCK_N), dtype=tl.float32)
        for s in range(KSPLIT):
            gate_part = partial_ptr + (2 * s * capacity).to(tl.int64) * inter_size + offs
            acc_up += tl.load(gate_part + capacity * inter_size, mask=row_mask[:, None], other=0.0)
            if GATED:
                acc_gate += tl.load(gate_part, mask=row_mask[:, None], other=0.0)
        if not GATED:
            acc_gate = acc_up
        token_scale = tl.load(token_scale_ptr + slot // top_k, mask=row_mask, other=1.0)
        _finish_rows(acc_gate, acc_up, expert, pos, row_mask, ncols, 1.0 / token_scale, h32_ptr, svh_addr_ptr,
                     suh_addr_ptr, bias_ptr, num_experts, inter_size, limit, GATED, ACTIVATION, HAS_LIMIT, HAS_BIAS,
                     SPLIT_BF16)


@triton.jit
def moe_down_kernel(
    h_rot_ptr, h_scale_ptr, y_ptr,
    block_expert_ptr, block_start_ptr, offsets_ptr, sorted_slots_ptr, num_rows,
    trellis_addr_ptr, svh_addr_ptr, k2_ptr, codebook_ptr,
    stage_addr_ptr, stage_k2_ptr, stage_codebook_ptr, stage_scale_ptr, bias_ptr,
    num_experts, hidden_size, inter_size,
    ROUTED: tl.constexpr, HAS_BIAS: tl.constexpr, NUM_STAGES: tl.constexpr, BM: tl.constexpr,
    DK: tl.constexpr, WPAD: tl.constexpr, USE_ASM: tl.constexpr, SPLIT_BF16: tl.constexpr,
):
    pid_b = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert, pos, row_mask, slot = _block_rows(pid_b, block_expert_ptr, block_start_ptr, offsets_ptr,
                                              sorted_slots_ptr, num_rows, BM, ROUTED)
    if expert >= 0:
        index = 2 * num_experts + expert
        words, k2, codebook = _entry(trellis_addr_ptr, k2_ptr, codebook_ptr, index)
        h_rows = h_rot_ptr + pos.to(tl.int64)[:, None] * inter_size
        tiles_n = hidden_size // 16
        acc = tl.zeros((BM, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, inter_size, DK):
            x = tl.load(h_rows + (k0 + tl.arange(0, DK))[None, :], mask=row_mask[:, None], other=0.0)
            acc = _project(acc, x, words, k2, codebook, index, k0, pid_n, tiles_n,
                           stage_addr_ptr, stage_k2_ptr, stage_codebook_ptr, stage_scale_ptr, 3 * num_experts,
                           NUM_STAGES, DK, WPAD, USE_ASM)
        ncols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        svh = tl.load(svh_addr_ptr + index).to(tl.pointer_type(tl.float16))
        unscale = 1.0 / tl.load(h_scale_ptr + pos, mask=row_mask, other=1.0)
        y = _epilogue(acc, svh, bias_ptr + expert.to(tl.int64) * hidden_size, ncols, unscale, HAS_BIAS, SPLIT_BF16)
        out = y_ptr + slot.to(tl.int64)[:, None] * hidden_size + ncols[None, :]
        tl.store(out, y, mask=row_mask[:, None])


def word_pad(max_k2: int) -> int:
    """WPAD: padded int32 words of one tile row of a [*, 128] block at the largest 2K of a launch."""
    return triton.next_power_of_2((BLOCK_N // 16) * 4 * max(max_k2, 2))


def launch_flags(t: torch.Tensor) -> tuple:
    """(USE_ASM, SPLIT_BF16): inline asm and bf16 tensor-core Hadamard in compiled GPU code only."""
    return (t.is_cuda and not interpreting()), split_bf16(t)


def moe_gate_up(hidden, token_scale, h32, route, num_rows, top_k, tables, grid_blocks, routed, block_m, decode_k,
                num_warps=NUM_WARPS, partial=None, splits=1):
    """Launch the gate/up kernel(s): h32 [>= rows, I] fp32 <- down's rotated input, from hidden's tokens times their
    powers of two token_scale [tokens] fp32 (undone before the activation); `route` = (block_expert, block_start,
    offsets, sorted_slots) int32 tensors (any int32 tensors when not `routed`: they are not read). With splits > 1
    (routed only) the hidden size is split over `splits` programs writing fp32 partials [splits, 2, capacity, I],
    summed in order by a second kernel."""
    block_expert, block_start, offsets, sorted_slots = route
    use_asm, split = launch_flags(hidden)
    bias = tables.bias_gate_up if tables.bias_gate_up is not None else tables.stage_scale
    limit = float(tables.limit) if tables.limit is not None else 0.0
    capacity = partial.numel() // (2 * splits * tables.intermediate_size) if splits > 1 else 0
    partial = partial if splits > 1 else h32
    grid = (grid_blocks, tables.intermediate_size // BLOCK_N, splits)
    moe_gate_up_kernel[grid](
        hidden, hidden.stride(0), token_scale, h32,
        block_expert, block_start, offsets, sorted_slots, num_rows, top_k,
        tables.trellis_addr, tables.suh_addr, tables.svh_addr, tables.k2, tables.codebook,
        tables.stage_addr, tables.stage_k2, tables.stage_codebook, tables.stage_scale, bias,
        tables.num_experts, tables.hidden_size, tables.intermediate_size, limit, partial, capacity,
        ROUTED=routed, GATED=tables.gated, ACTIVATION=ACTIVATION_ID[tables.activation],
        HAS_LIMIT=tables.limit is not None, HAS_BIAS=tables.bias_gate_up is not None,
        NUM_STAGES=tables.num_stages, BM=block_m, DK=decode_k, WPAD=word_pad(tables.max_k2_gate_up),
        USE_ASM=use_asm, SPLIT_BF16=split, KSPLIT=splits, num_warps=num_warps,
    )
    if splits > 1:
        moe_gate_up_finish_kernel[grid[:2]](
            partial, capacity, token_scale, top_k, h32, block_expert, block_start, offsets, sorted_slots,
            tables.svh_addr, tables.suh_addr, bias, tables.num_experts, tables.intermediate_size, limit,
            GATED=tables.gated, ACTIVATION=ACTIVATION_ID[tables.activation], HAS_LIMIT=tables.limit is not None,
            HAS_BIAS=tables.bias_gate_up is not None, BM=block_m, KSPLIT=splits, SPLIT_BF16=split, num_warps=8,
        )


def moe_down(h_rot, h_scale, y, route, num_rows, tables, grid_blocks, routed, block_m, decode_k,
             num_warps=NUM_WARPS):
    """Launch the down kernel: y <- down(h_rot / h_scale) per row (h_scale: moe_intermediate's powers of two; same
    `route` convention as moe_gate_up)."""
    block_expert, block_start, offsets, sorted_slots = route
    use_asm, split = launch_flags(h_rot)
    bias = tables.bias_down if tables.bias_down is not None else tables.stage_scale
    grid = (grid_blocks, tables.hidden_size // BLOCK_N)
    moe_down_kernel[grid](
        h_rot, h_scale, y, block_expert, block_start, offsets, sorted_slots, num_rows,
        tables.trellis_addr, tables.svh_addr, tables.k2, tables.codebook,
        tables.stage_addr, tables.stage_k2, tables.stage_codebook, tables.stage_scale, bias,
        tables.num_experts, tables.hidden_size, tables.intermediate_size,
        ROUTED=routed, HAS_BIAS=tables.bias_down is not None, NUM_STAGES=tables.num_stages, BM=block_m,
        DK=decode_k, WPAD=word_pad(tables.max_k2_down), USE_ASM=use_asm, SPLIT_BF16=split, num_warps=num_warps,
    )
