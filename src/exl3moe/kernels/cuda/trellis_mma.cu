// EXL3 linear on mma.sync m16n8k16: lane l decodes tile positions 8l..8l+7, which are its B fragments.
// Compile-time parameters (-D): K2 = 2K, CB (0 3inst, 1 mcg, 2 mul1), MT m16 tiles per block, NT n16 tiles per
// warp, PF k-tiles of trellis words prefetched per warp, WARPS warps per block, FUSE_IN (rotate x here).
// Each block writes part[split, row, col] (fp32, its k range); the last block of a 128-column group to arrive
// sums the splits in order and applies the output Hadamard, svh and bias: out = Hn(sum) * svh + bias.

typedef unsigned int u32;
typedef unsigned long long u64;

constexpr int WT = 4 * K2;                 // 32-bit words per 16x16 tile
constexpr int RING = 128 * K2;             // ring bits per tile
constexpr int S0 = K2 / 2;                 // S(0): end bit of position 0
constexpr int SPAN = (8 * K2) / 2 - S0 + 16;   // bits a lane reads: windows of its 8 positions
constexpr bool ALIGNED = (K2 % 8) == 0;    // the lane's first bit has the same offset in its word for every lane
constexpr int SH = ((S0 - 16) % 32 + 32) % 32;
constexpr int NW = ALIGNED ? (SH + SPAN + 31) / 32 : (31 + SPAN + 31) / 32;   // words loaded per tile
constexpr int XS = 136;                    // smem row stride of the x chunk (halves): conflict-free ldmatrix
constexpr int CHUNK = 8;                   // k-tiles per staged x chunk (128 inputs)

__device__ __forceinline__ u32 lop3_mask_xor(u32 x) {
    u32 r;
    asm("lop3.b32 %0, %1, %2, %3, 0x6a;" : "=r"(r) : "r"(x), "r"(0x8fff8fffu), "r"(0x3b603b60u));
    return r;
}

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
    u32 r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
    return r;
}

// Codebook values of states s0, s1 as an f16x2 (s0 in the low half).
__device__ __forceinline__ u32 decode_pair(u32 s0, u32 s1) {
#if CB == 2
    u32 x0 = s0 * 0x83DCD12Du, x1 = s1 * 0x83DCD12Du, h0, h1, r;
    asm("dp4a.u32.u32 %0, %1, %2, %3;" : "=r"(h0) : "r"(x0), "r"(0x01010101u), "r"(0x6400u));
    asm("dp4a.u32.u32 %0, %1, %2, %3;" : "=r"(h1) : "r"(x1), "r"(0x01010101u), "r"(0x6400u));
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(prmt(h0, h1, 0x5410)), "r"(0x1EEE1EEEu), "r"(0xC931C931u));
    return r;
#else
#if CB == 0
    u32 x0 = s0 * 89226354u + 64248484u, x1 = s1 * 89226354u + 64248484u;
#else
    u32 x0 = s0 * 0xCBAC1FEDu, x1 = s1 * 0xCBAC1FEDu;
#endif
    x0 = lop3_mask_xor(x0);
    x1 = lop3_mask_xor(x1);
    u32 r;
    asm("add.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(prmt(x0, x1, 0x5410)), "r"(prmt(x0, x1, 0x7632)));
    return r;
#endif
}

// Bits [B, B + 16) of the big-endian bit string s[0] s[1] ... as a 16-bit state.
template <int B>
__device__ __forceinline__ u32 window(const u32* s) {
    constexpr int wi = B >> 5, off = B & 31;
    if constexpr (off <= 16) {
        return (s[wi] >> (16 - off)) & 0xffffu;
    } else {
        return __funnelshift_r(s[wi + 1], s[wi], 48 - off) & 0xffffu;
    }
}

template <int Q>
__device__ __forceinline__ u32 state_of(const u32* s) {
    constexpr int start = ((Q + 1) * K2) / 2 - S0 + (ALIGNED ? SH : 0);
    return window<start>(s);
}

// The lane's 8 codebook values as 4 f16x2: B fragments {b[0], b[1]} of columns 0..7 and {b[2], b[3]} of 8..15.
__device__ __forceinline__ void decode_tile(const u32 (&w)[NW], u32 sh, u32 (&b)[4]) {
    u32 s[NW];
    if constexpr (ALIGNED) {
#pragma unroll
        for (int i = 0; i < NW; i++) s[i] = w[i];
    } else {
#pragma unroll
        for (int i = 0; i + 1 < NW; i++) s[i] = __funnelshift_l(w[i + 1], w[i], sh);
        s[NW - 1] = w[NW - 1] << sh;
    }
    b[0] = decode_pair(state_of<0>(s), state_of<1>(s));
    b[1] = decode_pair(state_of<2>(s), state_of<3>(s));
    b[2] = decode_pair(state_of<4>(s), state_of<5>(s));
    b[3] = decode_pair(state_of<6>(s), state_of<7>(s));
}

__device__ __forceinline__ void mma16816(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void ldmatrix_x4(u32 (&a)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3]) : "r"(addr));
}

constexpr float INV_SQRT_128 = 0.08838834764831845f;

__device__ __forceinline__ float half_to_float(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ unsigned short float_to_half(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ unsigned short float_to_bf16(float f) {
    unsigned short h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ float input_to_float(unsigned short v, int is_bf16) {
    return is_bf16 ? __uint_as_float((u32)v << 16) : half_to_float(v);
}

// Unnormalised 128-point Hadamard of a row held as v[j] = element 4 lane + j, across one warp.
__device__ __forceinline__ void hadamard128_warp(float (&v)[4], int lane) {
    float a0 = v[0] + v[1], a1 = v[0] - v[1], a2 = v[2] + v[3], a3 = v[2] - v[3];
    v[0] = a0 + a2; v[1] = a1 + a3; v[2] = a0 - a2; v[3] = a1 - a3;
#pragma unroll
    for (int m = 1; m < 32; m <<= 1) {
        const bool upper = lane & m;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const float other = __shfl_xor_sync(0xffffffffu, v[j], m);
            v[j] = upper ? other - v[j] : v[j] + other;
        }
    }
}

// xh [rows, k] fp16 = Hn128(x * suh) blockwise, with the arithmetic of trellis_mma's FUSE_IN staging (same bytes).
// One warp per (row, 128 inputs); blocks of 4 warps.
extern "C" __global__ void __launch_bounds__(128)
rotate_input(const unsigned short* __restrict__ x, int x_bf16, const unsigned short* __restrict__ suh,
             unsigned short* __restrict__ xh, int k, int stride_x) {
    const int lane = threadIdx.x & 31;
    const int chunk = blockIdx.x * 4 + (threadIdx.x >> 5);
    if (chunk * 128 >= k) return;
    const int c = chunk * 128 + 4 * lane;
    const unsigned short* xr = x + (size_t)blockIdx.y * stride_x + c;
    float v[4];
#pragma unroll
    for (int j = 0; j < 4; j++) v[j] = input_to_float(xr[j], x_bf16) * half_to_float(suh[c + j]);
    hadamard128_warp(v, lane);
#pragma unroll
    for (int j = 0; j < 4; j++) xh[(size_t)blockIdx.y * k + c + j] = float_to_half(v[j] * INV_SQRT_128);
}

extern "C" __global__ void __launch_bounds__(WARPS * 32)
trellis_mma(const unsigned short* __restrict__ x, int x_bf16, const unsigned short* __restrict__ suh,
            const u32* __restrict__ words, float* __restrict__ part, const unsigned short* __restrict__ svh,
            const unsigned short* __restrict__ bias, void* __restrict__ out, int out_dtype, int* __restrict__ counters,
            int rows, int n, int tiles_n, int ktiles_total, int ktiles_per_split, int stride_x, int stride_out,
            int splits) {
    __shared__ __align__(16) unsigned short xs[16 * MT * XS];
    __shared__ int is_last;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int split = blockIdx.y;
    const int m0 = blockIdx.z * 16 * MT;
    const int block_rows = min(16 * MT, rows - m0);
    const int kt0 = split * ktiles_per_split;
    const int kt1 = min(kt0 + ktiles_per_split, ktiles_total);
    const int jt0 = (blockIdx.x * WARPS + warp) * NT;

    // This lane's word pointers inside the first tile of its column, and the shift that aligns its first bit.
    const int first_bit = 4 * lane * K2 + S0 - 16 + RING;
    const u32 sh = first_bit & 31;
    const size_t k_stride = (size_t)tiles_n * WT;
    const u32* ptr[NW];
#pragma unroll
    for (int i = 0; i < NW; i++) ptr[i] = words + (size_t)jt0 * WT + ((first_bit >> 5) + i) % WT + kt0 * k_stride;

    float acc[MT][NT][2][4];
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int h = 0; h < 2; h++)
#pragma unroll
                for (int e = 0; e < 4; e++) acc[mt][nt][h][e] = 0.f;

    // Split ranges are whole chunks, so every k-tile of the loop exists; prefetches past the end re-read the last.
    u32 buf[PF][NT][NW];
#pragma unroll
    for (int p = 0; p < PF; p++) {
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int i = 0; i < NW; i++) buf[p][nt][i] = __ldg(ptr[i] + nt * WT);
        if (kt0 + p + 1 < kt1) {
#pragma unroll
            for (int i = 0; i < NW; i++) ptr[i] += k_stride;
        }
    }
    const u32 xs_lane = (u32)__cvta_generic_to_shared(xs + (lane & 15) * XS + (lane >> 4) * 8);

    for (int c0 = kt0; c0 < kt1; c0 += CHUNK) {
        __syncthreads();
#if FUSE_IN
        // xs = fp16(Hn128(x * suh)) of this chunk's 128 inputs, one row per warp at a time (rows past `rows` are
        // zeroed once, before the first chunk).
        if (c0 == kt0) {
            for (int v = threadIdx.x; v < (16 * MT - block_rows) * 128; v += WARPS * 32)
                xs[(block_rows + v / 128) * XS + v % 128] = 0;
        }
        for (int r = warp; r < block_rows; r += WARPS) {
            float v[4];
            const int c = c0 * 16 + 4 * lane;
            const unsigned short* xr = x + (size_t)(m0 + r) * stride_x + c;
#pragma unroll
            for (int j = 0; j < 4; j++) v[j] = input_to_float(xr[j], x_bf16) * half_to_float(suh[c + j]);
            hadamard128_warp(v, lane);
#pragma unroll
            for (int j = 0; j < 4; j++) xs[r * XS + 4 * lane + j] = float_to_half(v[j] * INV_SQRT_128);
        }
#else
        // x is already rotated (fp16): copy the chunk, zero rows past `rows`.
        for (int v = threadIdx.x; v < 16 * MT * 16; v += WARPS * 32) {
            const int r = v >> 4, c = (v & 15) * 8;
            uint4 val = make_uint4(0, 0, 0, 0);
            if (r < block_rows) val = *reinterpret_cast<const uint4*>(x + (size_t)(m0 + r) * stride_x + c0 * 16 + c);
            *reinterpret_cast<uint4*>(xs + r * XS + c) = val;
        }
#endif
        __syncthreads();
#pragma unroll
        for (int s = 0; s < CHUNK; s++) {
            const int slot = s % PF;
            u32 a[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; mt++) ldmatrix_x4(a[mt], xs_lane + (mt * 16 * XS + s * 16) * 2);
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                u32 b[4];
                decode_tile(buf[slot][nt], sh, b);
#pragma unroll
                for (int mt = 0; mt < MT; mt++) {
                    mma16816(acc[mt][nt][0], a[mt], b[0], b[1]);
                    mma16816(acc[mt][nt][1], a[mt], b[2], b[3]);
                }
            }
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int i = 0; i < NW; i++) buf[slot][nt][i] = __ldg(ptr[i] + nt * WT);
            if (c0 + s + PF + 1 < kt1) {
#pragma unroll
                for (int i = 0; i < NW; i++) ptr[i] += k_stride;
            }
        }
    }

    const int g = lane >> 2, t4 = lane & 3;
    float* mine = part + (size_t)split * rows * n;
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int half = 0; half < 2; half++) {
            const int r = mt * 16 + g + 8 * half;
            if (r < block_rows) {
#pragma unroll
                for (int nt = 0; nt < NT; nt++)
#pragma unroll
                    for (int h = 0; h < 2; h++) {
                        const int col = (jt0 + nt) * 16 + h * 8 + 2 * t4;
                        __stcg(reinterpret_cast<float2*>(mine + (size_t)(m0 + r) * n + col),
                               make_float2(acc[mt][nt][h][2 * half], acc[mt][nt][h][2 * half + 1]));
                    }
            }
        }

    // The last block of this (row block, 128 columns) to finish reduces the splits and writes the output.
    constexpr int BLOCK_COLS = WARPS * NT * 16;
    const int group_col = (blockIdx.x * BLOCK_COLS) / 128 * 128;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        const int group = blockIdx.z * (n / 128) + group_col / 128;
        const int arrivals = splits * (128 / BLOCK_COLS);
        const int seen = atomicAdd(counters + group, 1);
        is_last = seen == arrivals - 1;
        if (is_last) counters[group] = 0;
    }
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    const int c = group_col + 4 * lane;
    float sv[4], bv[4];
#pragma unroll
    for (int j = 0; j < 4; j++) {
        sv[j] = half_to_float(svh[c + j]);
        bv[j] = bias != nullptr ? half_to_float(bias[c + j]) : 0.f;
    }
    // MT rows per warp at a time, so their split loads are in flight together.
    for (int r0 = warp * MT; r0 < block_rows; r0 += WARPS * MT) {
        float v[MT][4];
#pragma unroll
        for (int i = 0; i < MT; i++)
#pragma unroll
            for (int j = 0; j < 4; j++) v[i][j] = 0.f;
        for (int s = 0; s < splits; s++) {
#pragma unroll
            for (int i = 0; i < MT; i++) {
                if (r0 + i < block_rows) {
                    const float4 p = __ldcg(reinterpret_cast<const float4*>(part + ((size_t)s * rows + m0 + r0 + i) * n + c));
                    v[i][0] += p.x; v[i][1] += p.y; v[i][2] += p.z; v[i][3] += p.w;
                }
            }
        }
#pragma unroll
        for (int i = 0; i < MT; i++) {
            hadamard128_warp(v[i], lane);
            if (r0 + i < block_rows) {
                const size_t o = (size_t)(m0 + r0 + i) * stride_out + c;
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    const float y = v[i][j] * INV_SQRT_128 * sv[j] + bv[j];
                    if (out_dtype == 2) reinterpret_cast<float*>(out)[o + j] = y;
                    else if (out_dtype == 1) reinterpret_cast<unsigned short*>(out)[o + j] = float_to_bf16(y);
                    else reinterpret_cast<unsigned short*>(out)[o + j] = float_to_half(y);
                }
            }
        }
    }
}
