"""Triton trellis decode: int16 tile rings -> fp16 W_inner blocks in natural [k, n] order, bit-exact.

The packed position of tile element (r, c) separates as p = row_part(r) + col_part(c), so each
element's ring words, shift and codebook work need no permutation; a block is decoded in place.
"""

import os

import torch
import triton
import triton.language as tl

from ..format.codebook import CODEBOOK_ID  # noqa: F401  (re-exported: the kernels' codebook ids)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def tile_row_part(r):
    """Packed-position contribution of tile row r (0..15)."""
    return 8 * ((r % 8) >> 1) + (r & 1) + 2 * (r >> 3)


@triton.jit
def tile_col_part(c):
    """Packed-position contribution of tile column c (0..15)."""
    return 32 * (c % 8) + 4 * (c >> 3)


@triton.jit
def ring_offsets(p, K2):
    """For packed positions p and 2K = K2: (word holding the window's last bit, word before it, right shift)."""
    words = 4 * K2
    end = (((p + 1) * K2) >> 1) + 128 * K2
    last = (end - 1) >> 5
    return last % words, (last - 1) % words, 32 * (last + 1) - end


@triton.jit
def window16(lo, hi, shift, USE_ASM: tl.constexpr):
    """Bits [shift, shift + 16) of the 64-bit value hi:lo (int32 words), as uint32."""
    if USE_ASM:
        w = tl.inline_asm_elementwise("shf.r.clamp.b32 $0, $1, $2, $3;", "=r,r,r,r", [lo, hi, shift],
                                      dtype=tl.int32, is_pure=True, pack=1)
        return w.to(tl.uint32, bitcast=True) & 0xFFFF
    lo_u = lo.to(tl.uint32, bitcast=True)
    hi_u = hi.to(tl.uint32, bitcast=True)
    sh = shift.to(tl.uint32)
    return ((lo_u >> sh) | ((hi_u << 1) << (31 - sh))) & 0xFFFF


@triton.jit
def _half_bits(bits):
    return bits.to(tl.uint16).to(tl.float16, bitcast=True)


@triton.jit
def codebook_value(state, CODEBOOK: tl.constexpr):
    """uint32 states (0..65535) -> fp16 codebook values (0 = 3inst, 1 = mcg, 2 = mul1), bit-exact."""
    if CODEBOOK == 2:
        x = state * 0x83DCD12D
        byte_sum = (x & 0xFF) + ((x >> 8) & 0xFF) + ((x >> 16) & 0xFF) + (x >> 24)
        scaled = (1024 + byte_sum).to(tl.int32) * 1774 - 2721792
        return (scaled.to(tl.float32) * 3.814697265625e-06).to(tl.float16)
    if CODEBOOK == 0:
        x = state * 89226354 + 64248484
    else:
        x = state * 0xCBAC1FED
    x = (x & 0x8FFF8FFF) ^ 0x3B603B60
    return (_half_bits(x & 0xFFFF).to(tl.float32) + _half_bits(x >> 16).to(tl.float32)).to(tl.float16)


@triton.jit
def decode_setup(BK: tl.constexpr, BN: tl.constexpr, K2, tiles_n):
    """Loop-invariant word offsets [BK, BN] of a tile-aligned block (relative to its first tile) and shifts."""
    rows = tl.arange(0, BK)
    cols = tl.arange(0, BN)
    p = tile_row_part(rows % 16)[:, None] + tile_col_part(cols % 16)[None, :]
    off_last, off_prev, shift = ring_offsets(p, K2)
    tile = ((rows // 16) * tiles_n)[:, None] + (cols // 16)[None, :]
    base = tile * (4 * K2)
    return base + off_last, base + off_prev, shift


@triton.jit
def decode_block(words_ptr, off_last, off_prev, shift, CODEBOOK: tl.constexpr, USE_ASM: tl.constexpr):
    """Decode one block given its first tile's int32 word pointer and decode_setup's tables."""
    lo = tl.load(words_ptr + off_last)
    hi = tl.load(words_ptr + off_prev)
    return codebook_value(window16(lo, hi, shift, USE_ASM), CODEBOOK)


@triton.jit
def _decode_kernel(words_ptr, out_ptr, tiles_n, n, K2: tl.constexpr, CODEBOOK: tl.constexpr,
                   BK: tl.constexpr, BN: tl.constexpr, USE_ASM: tl.constexpr):
    pid_k = tl.program_id(0)
    pid_n = tl.program_id(1)
    off_last, off_prev, shift = decode_setup(BK, BN, K2, tiles_n)
    first_tile = (pid_k * (BK // 16)) * tiles_n + pid_n * (BN // 16)
    w = decode_block(words_ptr + first_tile.to(tl.int64) * (4 * K2), off_last, off_prev, shift, CODEBOOK, USE_ASM)
    rows = pid_k * BK + tl.arange(0, BK)
    cols = pid_n * BN + tl.arange(0, BN)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * n + cols[None, :], w.to(out_ptr.dtype.element_ty))


def trellis_decode(trellis: torch.Tensor, K: float, codebook: str, out: torch.Tensor) -> torch.Tensor:
    """Write W_inner [k, n] of a contiguous int16 trellis into `out` (fp16: exact; fp32 also exact; bf16 rounds).
    No validation: ops validate."""
    tiles_k, tiles_n, _ = trellis.shape
    block_k = 16
    block_n = 64 if tiles_n % 4 == 0 else 16
    grid = (tiles_k * 16 // block_k, tiles_n * 16 // block_n)
    _decode_kernel[grid](trellis.view(torch.int32), out, tiles_n, tiles_n * 16, int(K * 2), CODEBOOK_ID[codebook],
                         block_k, block_n, not interpreting() and trellis.is_cuda)
    return out


@triton.jit
def gather_setup(BK: tl.constexpr, BN: tl.constexpr, K2, WPAD: tl.constexpr):
    """Indices into a [BK/16, WPAD] block of words (one padded row per tile row) and shifts."""
    rows = tl.arange(0, BK)
    cols = tl.arange(0, BN)
    p = tile_row_part(rows % 16)[:, None] + tile_col_part(cols % 16)[None, :]
    off_last, off_prev, shift = ring_offsets(p, K2)
    base = ((rows // 16) * WPAD)[:, None] + ((cols // 16) * (4 * K2))[None, :]
    return tl.reshape(base + off_last, [BK * BN]), tl.reshape(base + off_prev, [BK * BN]), shift


@triton.jit
def load_word_rows(words_ptr, tiles_n, K2, BK: tl.constexpr, BN: tl.constexpr, WPAD: tl.constexpr):
    """Coalesced load of a block's ring words: [BK/16, WPAD] int32, each row the block's tiles of one tile row."""
    tr = tl.arange(0, BK // 16)
    w = tl.arange(0, WPAD)
    ptrs = words_ptr + (tr * (tiles_n * 4 * K2))[:, None] + w[None, :]
    return tl.load(ptrs, mask=(w < (BN // 16) * 4 * K2)[None, :], other=0)


@triton.jit
def decode_words(lo, hi, shift, CODEBOOK: tl.constexpr, USE_ASM: tl.constexpr):
    """Window of hi:lo at `shift` -> fp16 codebook value (funnel shift and codebook in inline asm on the GPU)."""
    return codebook_asm(window16(lo, hi, shift, USE_ASM), CODEBOOK, USE_ASM)


@triton.jit
def lane_setup(BK: tl.constexpr, BN: tl.constexpr, K2: tl.constexpr, WPAD: tl.constexpr):
    """Per (tile slot, half-lane q = 2*lane + half): gather indices of its 3 ring words and its bit misalignment.

    Half-lane q covers packed positions 8*lane + 4*half .. +3; its bits start at S(first) - 16 (ring-biased).
    """
    TNB: tl.constexpr = BN // 16
    slot = tl.arange(0, (BK // 16) * TNB)
    q = tl.arange(0, 64)
    start = ((((q >> 1) * 8 + (q & 1) * 4 + 1) * K2) >> 1) + 128 * K2 - 16
    word = start >> 5
    base = ((slot // TNB) * WPAD + (slot % TNB) * (4 * K2))[:, None]
    i0 = base + (word % (4 * K2))[None, :]
    i1 = base + ((word + 1) % (4 * K2))[None, :]
    i2 = base + ((word + 2) % (4 * K2))[None, :]
    misalign = (start & 31)[None, :] + 0 * slot[:, None]
    return i0, i1, i2, misalign


@triton.jit
def _shift_left_pair(hi, lo, n, USE_ASM: tl.constexpr):
    """Upper 32 bits of (hi:lo) << n, n in 0..31, as uint32."""
    if USE_ASM:
        r = tl.inline_asm_elementwise("shf.l.clamp.b32 $0, $1, $2, $3;", "=r,r,r,r", [lo, hi, n],
                                      dtype=tl.int32, is_pure=True, pack=1)
        return r.to(tl.uint32, bitcast=True)
    hu = hi.to(tl.uint32, bitcast=True)
    lu = lo.to(tl.uint32, bitcast=True)
    nu = n.to(tl.uint32)
    return (hu << nu) | ((lu >> 1) >> (31 - nu))


@triton.jit
def _window_at(hi, lo, D: tl.constexpr):
    """16 bits starting D bits below the top of the aligned 64-bit hi:lo (constant shifts only)."""
    if D + 16 <= 32:
        w = hi >> (16 - D)
    elif D >= 32:
        w = lo >> (48 - D)
    else:
        w = (hi << (D - 16)) | (lo >> (48 - D))
    return w & 0xFFFF


@triton.jit
def codebook_asm(state, CODEBOOK: tl.constexpr, USE_ASM: tl.constexpr):
    """uint32 state -> fp16 value; inline asm on the GPU, portable Triton otherwise."""
    if not USE_ASM:
        v = codebook_value(state, CODEBOOK)
    elif CODEBOOK == 0:
        v = tl.inline_asm_elementwise(ASM_CB_3INST, "=h,r", [state.to(tl.int32, bitcast=True)], dtype=tl.float16,
                                      is_pure=True, pack=1)
    elif CODEBOOK == 1:
        v = tl.inline_asm_elementwise(ASM_CB_MCG, "=h,r", [state.to(tl.int32, bitcast=True)], dtype=tl.float16,
                                      is_pure=True, pack=1)
    else:
        v = tl.inline_asm_elementwise(ASM_CB_MUL1, "=h,r", [state.to(tl.int32, bitcast=True)], dtype=tl.float16,
                                      is_pure=True, pack=1)
    return v


_ASM_CB_LOP3 = """{
 .reg .b32 x; .reg .b16 lo, hi;
 MULTIPLY
 lop3.b32 x, x, 0x8FFF8FFF, 0x3B603B60, 0x6A;
 mov.b32 {lo, hi}, x;
 add.rn.f16 $0, lo, hi;
}"""
ASM_CB_3INST = tl.constexpr(_ASM_CB_LOP3.replace("MULTIPLY", "mad.lo.u32 x, $1, 89226354, 64248484;"))
ASM_CB_MCG = tl.constexpr(_ASM_CB_LOP3.replace("MULTIPLY", "mul.lo.u32 x, $1, 0xCBAC1FED;"))
ASM_CB_MUL1 = tl.constexpr("""{
 .reg .b32 x; .reg .b16 h, kinv, kbias, unused;
 mul.lo.u32 x, $1, 0x83DCD12D;
 dp4a.u32.u32 x, x, 0x01010101, 0x6400;
 mov.b32 {h, unused}, x;
 mov.b16 kinv, 0x1EEE;
 mov.b16 kbias, 0xC931;
 fma.rn.f16 $0, h, kinv, kbias;
}""")


@triton.jit
def decode_lanes(word_rows, i0, i1, i2, misalign, BK: tl.constexpr, BN: tl.constexpr, WPAD: tl.constexpr,
                 K2: tl.constexpr, CODEBOOK: tl.constexpr, USE_ASM: tl.constexpr):
    """Decode a [BK, BN] block: each half-lane aligns its 3 words once, then cuts 4 windows at constant offsets."""
    NT: tl.constexpr = (BK // 16) * (BN // 16)
    flat = tl.reshape(word_rows, [(BK // 16) * WPAD])
    w0 = tl.reshape(tl.gather(flat, tl.reshape(i0, [NT * 64]), 0), [NT, 64])
    w1 = tl.reshape(tl.gather(flat, tl.reshape(i1, [NT * 64]), 0), [NT, 64])
    w2 = tl.reshape(tl.gather(flat, tl.reshape(i2, [NT * 64]), 0), [NT, 64])
    hi = _shift_left_pair(w0, w1, misalign, USE_ASM)
    lo = _shift_left_pair(w1, w2, misalign, USE_ASM)
    D0: tl.constexpr = 0
    D1: tl.constexpr = ((2 * K2) >> 1) - (K2 >> 1)
    D2: tl.constexpr = ((3 * K2) >> 1) - (K2 >> 1)
    D3: tl.constexpr = ((4 * K2) >> 1) - (K2 >> 1)
    v0 = codebook_asm(_window_at(hi, lo, D0), CODEBOOK, USE_ASM)
    v1 = codebook_asm(_window_at(hi, lo, D1), CODEBOOK, USE_ASM)
    v2 = codebook_asm(_window_at(hi, lo, D2), CODEBOOK, USE_ASM)
    v3 = codebook_asm(_window_at(hi, lo, D3), CODEBOOK, USE_ASM)
    quad = tl.join(tl.join(v0, v1), tl.join(v2, v3))
    quad = tl.reshape(quad, [BK // 16, BN // 16, 8, 4, 2, 2, 2])
    return tl.reshape(tl.permute(quad, (0, 6, 3, 5, 1, 4, 2)), [BK, BN])
