// moe_mma.cu's moe_rotate_input: every routed row rotated once for gate and up (quads of lanes per 128 inputs).
#pragma once
#if !WS
// v[8 i + j] = element 32 i + 8 q + j of a 128-input row held by the four lanes q = lane % 4 of a quad: its
// unnormalised Hadamard with the butterflies and roundings of hadamard128_warp, bits 0..6 in order (bits 0..2 and
// 5..6 in registers, 3 and 4 across the quad).
__device__ __forceinline__ void hadamard128_quad(float (&v)[32], int q) {
    auto in_registers = [&](int m) {
#pragma unroll
        for (int j = 0; j < 32; j++)
            if (!(j & m)) {
                const float a = v[j], b = v[j | m];
                v[j] = a + b;
                v[j | m] = a - b;
            }
    };
    in_registers(1);
    in_registers(2);
    in_registers(4);
#pragma unroll
    for (int m = 1; m <= 2; m <<= 1) {
        const float sign = q & m ? -1.f : 1.f;
#pragma unroll
        for (int j = 0; j < 32; j++) {
            const float other = __shfl_xor_sync(0xffffffffu, v[j], m);
            v[j] = __fmaf_rn(v[j], sign, other);
        }
    }
    in_registers(8);
    in_registers(16);
}

// Eight fp16 (or, BF16, bf16) values from p as floats: one 16-byte load when VECTOR (p 16-byte aligned).
template <bool BF16, bool VECTOR>
__device__ __forceinline__ void load8(float* out, const unsigned short* p) {
    u32 words[4];
    if (VECTOR) {
        const uint4 w = *reinterpret_cast<const uint4*>(p);
        words[0] = w.x, words[1] = w.y, words[2] = w.z, words[3] = w.w;
    } else {
#pragma unroll
        for (int j = 0; j < 4; j++) words[j] = p[2 * j] | (u32)p[2 * j + 1] << 16;
    }
#pragma unroll
    for (int j = 0; j < 4; j++) {
        if (BF16) {
            out[2 * j] = __uint_as_float(words[j] << 16);
            out[2 * j + 1] = __uint_as_float(words[j] & 0xffff0000u);
        } else {
            asm("{ .reg .f16 lo, hi; mov.b32 {lo, hi}, %2; cvt.f32.f16 %0, lo; cvt.f32.f16 %1, hi; }"
                : "=f"(out[2 * j]), "=f"(out[2 * j + 1]) : "r"(words[j]));
        }
    }
}

// fp16 of (lo, hi) rounded to nearest, lo in the low half.
__device__ __forceinline__ u32 pack_half2(float lo, float hi) {
    u32 h;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(h) : "f"(hi), "f"(lo));
    return h;
}

// x_rot[p, pos] = gate (p 0) or up (p 1) rotated input of every routed position: grid (route block, 2,
// BLOCK_M / ROTATE_ROWS); each quad of lanes rotates one (row, 128 inputs) item of the block's ROTATE_ROWS rows.
// The same bytes gate/up computes itself without PRE_ROTATED. flags: bit 0 bf16 x, bit 1 x and suh 16-byte aligned.
constexpr int ROTATE_ROWS = 8;

template <bool BF16, bool VECTOR>
__device__ __forceinline__ void rotate_rows(const unsigned short* __restrict__ x, int stride_x, u32 row_slot,
                                            int top_k, const unsigned short* __restrict__ suh, int hidden, int rows,
                                            unsigned short* __restrict__ dst) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, q = lane & 3, chunks = hidden / 128;
    // slot / top_k as a multiply-high: exact for slots below 2^32 / top_k
    const u32 magic = top_k > 1 ? 0xffffffffu / (u32)top_k + 1u : 0u;
    // A warp takes eight items at a time (one per quad); quads past the last item redo it and store nothing, so
    // every lane reaches the shuffles.
    for (int base = 8 * warp; base < rows * chunks; base += 8 * WARPS) {
        const int item = min(base + (lane >> 2), rows * chunks - 1), r = item / chunks;
        const int c = (item % chunks) * 128 + 8 * q;   // the quad's pieces of 64 bytes are contiguous
        const u32 slot = __shfl_sync(0xffffffffu, row_slot, r), token = magic ? __umulhi(slot, magic) : slot;
        const unsigned short* xr = x + (size_t)token * stride_x + c;
        float v[32];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            float s[8];
            load8<BF16, VECTOR>(v + 8 * i, xr + 32 * i);
            load8<false, VECTOR>(s, suh + c + 32 * i);
#pragma unroll
            for (int j = 0; j < 8; j++) v[8 * i + j] *= s[j];
        }
        hadamard128_quad(v, q);
        if (base + (lane >> 2) < rows * chunks) {
            unsigned short* out = dst + (size_t)r * hidden + c;   // workspace rows: 256-byte aligned
#pragma unroll
            for (int i = 0; i < 4; i++) {
                u32 w[4];
#pragma unroll
                for (int j = 0; j < 4; j++)
                    w[j] = pack_half2(v[8 * i + 2 * j] * INV_SQRT_128, v[8 * i + 2 * j + 1] * INV_SQRT_128);
                *reinterpret_cast<uint4*>(out + 32 * i) = make_uint4(w[0], w[1], w[2], w[3]);
            }
        }
    }
}

extern "C" __global__ void KERNEL_BOUNDS
moe_rotate_input(const unsigned short* __restrict__ x, int flags, int stride_x,
                 const int* __restrict__ block_expert, const int* __restrict__ block_start,
                 const int* __restrict__ offsets, const int* __restrict__ sorted_slots, int top_k,
                 const long long* __restrict__ suh_addr, int num_experts, int hidden, int capacity,
                 unsigned short* __restrict__ x_rot) {
    int expert, start, nrows;
    if (!route_block(blockIdx.x, block_expert, block_start, offsets, 0, num_experts, expert, start, nrows)) return;
    const int lane = threadIdx.x & 31, proj = blockIdx.y;
    const int r0 = blockIdx.z * ROTATE_ROWS, rows = min(ROTATE_ROWS, nrows - r0);
    const unsigned short* suh = reinterpret_cast<const unsigned short*>(suh_addr[proj * num_experts + expert]);
    unsigned short* dst = x_rot + ((size_t)proj * capacity + start + r0) * hidden;
    const u32 row_slot = lane < rows ? sorted_slots[start + r0 + lane] : 0u;   // lane r: the slot of row r
    switch (flags & 3) {
        case 0: rotate_rows<false, false>(x, stride_x, row_slot, top_k, suh, hidden, rows, dst); break;
        case 1: rotate_rows<true, false>(x, stride_x, row_slot, top_k, suh, hidden, rows, dst); break;
        case 2: rotate_rows<false, true>(x, stride_x, row_slot, top_k, suh, hidden, rows, dst); break;
        default: rotate_rows<true, true>(x, stride_x, row_slot, top_k, suh, hidden, rows, dst); break;
    }
}

#endif
