// Shared device code of the CUDA C++ kernels: trellis decode into mma.sync m16n8k16 B fragments, MMA and
// ldmatrix wrappers, fp16/bf16 conversions and the warp-wide 128-point Hadamard.
#pragma once

typedef unsigned int u32;
typedef unsigned long long u64;

constexpr int XS = 136;                    // smem row stride of the x chunk (halves): conflict-free ldmatrix
constexpr int CHUNK = 8;                   // k-tiles per staged x chunk (128 inputs)
// Pair sums (same bits): 0 PRMT + HADD2 (ALU pipe), 1 scalar HADDs + a pack, 2 scalar HADDs packed on the FMA pipe,
// 3 alternating 1 and 2.
#ifndef PAIR_SCALAR
#define PAIR_SCALAR 0
#endif
#ifndef KTILE_UNROLL
#define KTILE_UNROLL CHUNK                 // k-tiles per unrolled mainloop body: a multiple of PF, dividing CHUNK
#endif
static_assert(CHUNK % KTILE_UNROLL == 0, "KTILE_UNROLL must divide CHUNK");
#ifndef BLOCK_TRACE
#define BLOCK_TRACE 0                      // timing builds: thread 0 of every block prints its phase marks
#endif

#if BLOCK_TRACE
// Thread 0's marks: globaltimer (ns) at the start and at the print, SM clock cycles since the start at each mark.
struct BlockTrace {
    unsigned long long start_ns;
    long long start_clock;
    int marks[6] = {};
    __device__ BlockTrace() : start_clock(clock64()) { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start_ns)); }
    __device__ void mark(int i) { marks[i] = (int)(clock64() - start_clock); }
    __device__ void print(int kernel) const {
        unsigned long long end_ns;
        int smid;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(end_ns));
        asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
        if (threadIdx.x == 0)
            printf("TR %d %d %d %d %d %llu %llu %d %d %d %d %d %d\n", kernel, blockIdx.x, blockIdx.y, blockIdx.z, smid,
                   start_ns, end_ns, marks[0], marks[1], marks[2], marks[3], marks[4], marks[5]);
    }
};
#define TRACE_BEGIN BlockTrace block_trace
#define TRACE_MARK(i) block_trace.mark(i)
#define TRACE_PRINT(kernel) block_trace.print(kernel)
#else
#define TRACE_BEGIN
#define TRACE_MARK(i)
#define TRACE_PRINT(kernel)
#endif

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
template <int CB_, int PS = PAIR_SCALAR>
__device__ __forceinline__ u32 decode_pair(u32 s0, u32 s1) {
    if constexpr (CB_ == 2) {
    u32 x0 = s0 * 0x83DCD12Du, x1 = s1 * 0x83DCD12Du, h0, h1, r;
    asm("dp4a.u32.u32 %0, %1, %2, %3;" : "=r"(h0) : "r"(x0), "r"(0x01010101u), "r"(0x6400u));
    asm("dp4a.u32.u32 %0, %1, %2, %3;" : "=r"(h1) : "r"(x1), "r"(0x01010101u), "r"(0x6400u));
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(prmt(h0, h1, 0x5410)), "r"(0x1EEE1EEEu), "r"(0xC931C931u));
    return r;
    } else {
    u32 x0 = CB_ == 0 ? s0 * 89226354u + 64248484u : s0 * 0xCBAC1FEDu;
    u32 x1 = CB_ == 0 ? s1 * 89226354u + 64248484u : s1 * 0xCBAC1FEDu;
    x0 = lop3_mask_xor(x0);
    x1 = lop3_mask_xor(x1);
    u32 r;
    if constexpr (PS == 1) {
    asm("{ .reg .f16 a, b, c, d, e, f; mov.b32 {a, b}, %1; mov.b32 {c, d}, %2; add.rn.f16 e, a, b; "
        "add.rn.f16 f, c, d; mov.b32 %0, {e, f}; }" : "=r"(r) : "r"(x0), "r"(x1));
    } else if constexpr (PS == 2) {
    asm("{ .reg .f16 a, b, c, d, e, f; .reg .b32 ee, ff, g; mov.b32 {a, b}, %1; mov.b32 {c, d}, %2; "
        "add.rn.f16 e, a, b; add.rn.f16 f, c, d; mov.b32 ee, {e, e}; mov.b32 ff, {f, f}; "
        "mul.rn.f16x2 g, ff, %3; fma.rn.f16x2 %0, ee, %4, g; }"
        : "=r"(r) : "r"(x0), "r"(x1), "r"(0x3C000000u), "r"(0x00003C00u));
    } else {
    asm("add.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(prmt(x0, x1, 0x5410)), "r"(prmt(x0, x1, 0x7632)));
    }
    return r;
    }
}

// Bits [B, B + 16) of the big-endian bit string s[0] s[1] ... as a 16-bit state.
template <int B>
__device__ __forceinline__ u32 window(const u32* s) {
    constexpr int wi = B >> 5, off = B & 31, r = off % 8;
    if constexpr (off < 16) {
        u32 c = s[wi];   // a copy shifted by 1..7 bits serves the windows 8 bits apart (asm: never refolded)
        if constexpr (r > 0) asm("shl.b32 %0, %1, %2;" : "=r"(c) : "r"(s[wi]), "n"(r));
        return off == r ? c >> 16 : prmt(c, 0u, 0x4421);
    } else if constexpr (off == 16) {
        return s[wi] & 0xffffu;
    } else {
        return __funnelshift_r(s[wi + 1], s[wi], 48 - off) & 0xffffu;
    }
}

// Bits [B, B + 32) of the big-endian bit string s[0] s[1] ...
template <int B>
__device__ __forceinline__ u32 window32(const u32* s) {
    constexpr int wi = B >> 5, off = B & 31;
    if constexpr (off == 0) {
        return s[wi];
    } else {
        return __funnelshift_r(s[wi + 1], s[wi], 32 - off);
    }
}

// Tile geometry and decode of one (2K, codebook): lane l reads the bits of positions 8l..8l+7.
template <int K2_, int CB_>
struct Trellis {
    static constexpr int WT = 4 * K2_;                 // 32-bit words per 16x16 tile
    static constexpr int RING = 128 * K2_;             // ring bits per tile
    static constexpr int S0 = K2_ / 2;                 // S(0): end bit of position 0
    static constexpr int SPAN = (8 * K2_) / 2 - S0 + 16;   // bits a lane reads: windows of its 8 positions
    static constexpr bool ALIGNED = (K2_ % 8) == 0;    // the lane's first bit sits at the same offset for every lane
    static constexpr int SH = ((S0 - 16) % 32 + 32) % 32;
    static constexpr int NW = ALIGNED ? (SH + SPAN + 31) / 32 : (31 + SPAN + 31) / 32;   // words loaded per tile

    static constexpr int PAIR_GAP = 32 % K2_ == 0 ? 32 / K2_ : 8;   // positions between windows 16 bits apart

    template <int Q>
    static constexpr int start_of() { return ((Q + 1) * K2_) / 2 - S0 + (ALIGNED ? SH : 0); }

    // The 8 states of the lane's positions Q..7: a window 16 bits after another comes from the same 32 bits.
    template <int Q>
    __device__ static __forceinline__ void states_from(const u32* s, u32 (&st)[8]) {
        if constexpr (Q < 8) {
            constexpr bool paired = PAIR_GAP < 8;
            if constexpr (paired && (Q / PAIR_GAP) % 2 == 0) {
                const u32 z = window32<start_of<Q>()>(s);
                st[Q] = z >> 16;
                st[Q + PAIR_GAP] = z & 0xffffu;
            } else if constexpr (!paired) {
                st[Q] = window<start_of<Q>()>(s);
            }
            states_from<Q + 1>(s, st);
        }
    }

    // First ring bit of this lane's windows (biased by one ring so it is never negative).
    __device__ static __forceinline__ int first_bit(int lane) { return 4 * lane * K2_ + S0 - 16 + RING; }

    // The lane's 8 codebook values as 4 f16x2: B fragments {b[0], b[1]} of columns 0..7, {b[2], b[3]} of 8..15.
    __device__ static __forceinline__ void decode_tile(const u32 (&w)[NW], u32 sh, u32 (&b)[4]) {
        u32 s[NW];
        if constexpr (ALIGNED) {
#pragma unroll
            for (int i = 0; i < NW; i++) s[i] = w[i];
        } else {
#pragma unroll
            for (int i = 0; i + 1 < NW; i++) s[i] = __funnelshift_l(w[i + 1], w[i], sh);
            s[NW - 1] = w[NW - 1] << sh;
        }
        u32 st[8];
        states_from<0>(s, st);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            constexpr int ps = PAIR_SCALAR == 3 ? 1 : PAIR_SCALAR;   // 3: odd pairs on the FMA pipe (2), even as 1
            b[i] = PAIR_SCALAR == 3 && i % 2 ? decode_pair<CB_, 2>(st[2 * i], st[2 * i + 1])
                                             : decode_pair<CB_, ps>(st[2 * i], st[2 * i + 1]);
        }
    }
};

// One lane's trellis words of a tile column: NW pointers into the tile at some k-tile, stepped along k; `shift`
// aligns the lane's first bit (decode_tile's sh).
template <class T>
struct WordStream {
    const u32* ptr[T::NW];
    u32 shift;

    __device__ __forceinline__ WordStream(const u32* words, int jt, size_t kt_offset) {
        const int first_bit = T::first_bit(threadIdx.x & 31);
        shift = first_bit & 31;
#pragma unroll
        for (int i = 0; i < T::NW; i++)
            ptr[i] = words + (size_t)jt * T::WT + ((first_bit >> 5) + i) % T::WT + kt_offset;
    }

    // w = this lane's words of the tile `offset` words further on (another column or k-tile).
    __device__ __forceinline__ void load(u32 (&w)[T::NW], size_t offset = 0) const {
#pragma unroll
        for (int i = 0; i < T::NW; i++) w[i] = __ldg(ptr[i] + offset);
    }

    __device__ __forceinline__ void advance(size_t step) {
#pragma unroll
        for (int i = 0; i < T::NW; i++) ptr[i] += step;
    }
};

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
        const float sign = lane & m ? -1.f : 1.f;   // upper lanes: other - v; one rounding either way, as an add
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const float other = __shfl_xor_sync(0xffffffffu, v[j], m);
            v[j] = __fmaf_rn(v[j], sign, other);
        }
    }
}

// Block-wide k loop over k-tiles [kt0, kt1) (whole chunks of CHUNK): before each chunk, stage(c0) fills xs
// (16 MT_ rows x 128 inputs, fp16, row stride XS) between barriers; each warp multiplies its first `mtiles` m16
// tiles by its NT_ n16 tiles of W_inner from tile column jt0, prefetching PF_ k-tiles of trellis words.
// acc += xs @ W (m16 tiles from `mtiles` on are left as they are).
template <int K2_, int CB_, int MT_, int NT_, int PF_, class Stage>
__device__ __forceinline__ void mma_mainloop(float (&acc)[MT_][NT_][2][4], const u32* __restrict__ words, int tiles_n,
                                             int jt0, int kt0, int kt1, int mtiles, const unsigned short* xs,
                                             Stage&& stage) {
    using T = Trellis<K2_, CB_>;
    static_assert(KTILE_UNROLL % PF_ == 0, "KTILE_UNROLL must be a multiple of the prefetch depth");
    const int lane = threadIdx.x & 31;
    const size_t k_stride = (size_t)tiles_n * T::WT;
    WordStream<T> stream(words, jt0, kt0 * k_stride);
    const u32 sh = stream.shift;

    // Split ranges are whole chunks, so every k-tile of the loop exists; prefetches past the end re-read the last.
    u32 buf[PF_][NT_][T::NW];
#pragma unroll
    for (int p = 0; p < PF_; p++) {
#pragma unroll
        for (int nt = 0; nt < NT_; nt++) stream.load(buf[p][nt], nt * T::WT);
        if (kt0 + p + 1 < kt1) stream.advance(k_stride);
    }
    const u32 xs_lane = (u32)__cvta_generic_to_shared(xs + (lane & 15) * XS + (lane >> 4) * 8);

    for (int c0 = kt0; c0 < kt1; c0 += CHUNK) {
        __syncthreads();
        stage(c0);
        __syncthreads();
#pragma unroll 1
        for (int s0 = 0; s0 < CHUNK; s0 += KTILE_UNROLL) {
#pragma unroll
        for (int sp = 0; sp < KTILE_UNROLL; sp++) {
            const int s = s0 + sp, slot = sp % PF_;
            // All B fragments, then A fragments double-buffered: 8 registers of A instead of MT_ x 4.
            u32 b[NT_][4], a[2][4];
#pragma unroll
            for (int nt = 0; nt < NT_; nt++) T::decode_tile(buf[slot][nt], sh, b[nt]);
            ldmatrix_x4(a[0], xs_lane + s * 16 * 2);
#pragma unroll
            for (int mt = 0; mt < MT_; mt++) {
                if (mt + 1 < MT_ && mt + 1 < mtiles)
                    ldmatrix_x4(a[(mt + 1) & 1], xs_lane + ((mt + 1) * 16 * XS + s * 16) * 2);
                if (mt < mtiles) {
#pragma unroll
                    for (int nt = 0; nt < NT_; nt++) {
                        mma16816(acc[mt][nt][0], a[mt & 1], b[nt][0], b[nt][1]);
                        mma16816(acc[mt][nt][1], a[mt & 1], b[nt][2], b[nt][3]);
                    }
                }
            }
#pragma unroll
            for (int nt = 0; nt < NT_; nt++) stream.load(buf[slot][nt], nt * T::WT);
            if (c0 + s + PF_ + 1 < kt1) stream.advance(k_stride);
        }
        }
    }
}

// acc = f(acc), element by element.
template <int MT_, int NT_, class F>
__device__ __forceinline__ void each_acc(float (&acc)[MT_][NT_][2][4], F f) {
#pragma unroll
    for (int mt = 0; mt < MT_; mt++)
#pragma unroll
        for (int nt = 0; nt < NT_; nt++)
#pragma unroll
            for (int h = 0; h < 2; h++)
#pragma unroll
                for (int e = 0; e < 4; e++) acc[mt][nt][h][e] = f(acc[mt][nt][h][e]);
}

template <int MT_, int NT_>
__device__ __forceinline__ void zero_acc(float (&acc)[MT_][NT_][2][4]) {
    each_acc(acc, [](float) { return 0.f; });
}

// Rows [0, rows) of the warp's accumulators to base[r * row_stride + col] (fp32, through L2 for the reducer).
template <int MT_, int NT_>
__device__ __forceinline__ void store_partials(const float (&acc)[MT_][NT_][2][4], float* base, int row_stride,
                                               int rows, int jt0) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
#pragma unroll
    for (int mt = 0; mt < MT_; mt++)
#pragma unroll
        for (int half = 0; half < 2; half++) {
            const int r = mt * 16 + g + 8 * half;
            if (r < rows) {
#pragma unroll
                for (int nt = 0; nt < NT_; nt++)
#pragma unroll
                    for (int h = 0; h < 2; h++) {
                        const int col = (jt0 + nt) * 16 + h * 8 + 2 * t4;
                        __stcg(reinterpret_cast<float2*>(base + (size_t)r * row_stride + col),
                               make_float2(acc[mt][nt][h][2 * half], acc[mt][nt][h][2 * half + 1]));
                    }
            }
        }
}

// True in every thread of the block that is the last of `arrivals` to reach *counter (which it resets to 0);
// its later reads see every earlier arrival's partials. The block's writes reach thread 0 through the barrier, and
// its acq_rel atomic releases them and acquires the earlier arrivals' (the grid-barrier pattern).
__device__ __forceinline__ bool last_arrival(int* counter, int arrivals) {
    __shared__ int is_last;
    __syncthreads();
    if (threadIdx.x == 0) {
        int seen;
        asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;" : "=r"(seen) : "l"(counter) : "memory");
        is_last = seen == arrivals - 1;
        if (is_last) *counter = 0;
    }
    __syncthreads();
    return is_last;
}

// v[j] += sum over s < splits, in order, of p[s * split_stride + j] (4 consecutive fp32, read through L2). BATCH > 1
// issues the loads of BATCH splits together, the additions still in split order (the same bytes); PAD runs the last
// partial batch the same way (else split by split). Both change how ptxas allocates the rest of the kernel, so
// callers choose them per kernel.
template <int BATCH = 1, bool PAD = false>
__device__ __forceinline__ void add_splits(float (&v)[4], const float* p, size_t split_stride, int splits) {
    int s = 0;
    if constexpr (BATCH > 1) {
        for (; PAD ? s < splits : s + BATCH <= splits; s += BATCH) {
            float4 q[BATCH];
#pragma unroll
            for (int b = 0; b < BATCH; b++)
                if (!PAD || s + b < splits) q[b] = __ldcg(reinterpret_cast<const float4*>(p + (s + b) * split_stride));
#pragma unroll
            for (int b = 0; b < BATCH; b++)
                if (!PAD || s + b < splits) {
                    v[0] += q[b].x; v[1] += q[b].y; v[2] += q[b].z; v[3] += q[b].w;
                }
        }
    }
    for (; s < splits; s++) {
        const float4 q = __ldcg(reinterpret_cast<const float4*>(p + s * split_stride));
        v[0] += q.x; v[1] += q.y; v[2] += q.z; v[3] += q.w;
    }
}

// Lane l asks L2 for bytes [128 l, 128 l + 128) of p (an epilogue's vector slice), so the epilogue finds them there.
__device__ __forceinline__ void prefetch_l2(const void* p, int bytes, int lane) {
    if (p != nullptr && 128 * lane < bytes)
        asm volatile("prefetch.global.L2 [%0];" ::"l"(reinterpret_cast<const char*>(p) + 128 * lane));
}

// The warp asks L2 for the 128-byte lines holding bytes [0, bytes) of p, up to 32 lines (one per lane).
__device__ __forceinline__ void prefetch_l2_lines(const void* p, int bytes, int lane) {
    const size_t first = reinterpret_cast<size_t>(p) & ~(size_t)127, line = first + 128 * lane;
    if (line < reinterpret_cast<size_t>(p) + bytes) asm volatile("prefetch.global.L2 [%0];" ::"l"(line));
}

template <int MT_, int NT_>
__device__ __forceinline__ void scale_acc(float (&acc)[MT_][NT_][2][4], float f) {
    each_acc(acc, [f](float a) { return a * f; });
}

// out[m0 + r, group_col + j] = Hn(v) * svh + bias for rows r < block_rows of a 128-column group, where sum(v, r)
// adds row r's fp32 sums into v (zeroed; elements 4 lane + j); R rows per warp at a time.
template <int R, class Sum>
__device__ __forceinline__ void finish_group(Sum&& sum, const unsigned short* svh, const unsigned short* bias,
                                             void* out, int out_dtype, int m0, int block_rows, int group_col,
                                             int stride_out, int warps) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int c = group_col + 4 * lane;
    float sv[4], bv[4];
#pragma unroll
    for (int j = 0; j < 4; j++) {
        sv[j] = half_to_float(svh[c + j]);
        bv[j] = bias != nullptr ? half_to_float(bias[c + j]) : 0.f;
    }
    for (int r0 = warp * R; r0 < block_rows; r0 += warps * R) {
        float v[R][4];
#pragma unroll
        for (int i = 0; i < R; i++)
#pragma unroll
            for (int j = 0; j < 4; j++) v[i][j] = 0.f;
#pragma unroll
        for (int i = 0; i < R; i++)
            if (r0 + i < block_rows) sum(v[i], r0 + i);
#pragma unroll
        for (int i = 0; i < R; i++) {
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

// The last block of a (row block, 128 columns) group: finish_group over the sum of the splits of part, in order.
template <int R, int BATCH, bool PAD = false>
__device__ __forceinline__ void reduce_group(const float* part, const unsigned short* svh, const unsigned short* bias,
                                             void* out, int out_dtype, int rows, int n, int m0, int block_rows,
                                             int group_col, int stride_out, int splits, int warps) {
    const int c = group_col + 4 * (threadIdx.x & 31);
    auto sum = [&](float (&v)[4], int r) {
        add_splits<BATCH, PAD>(v, part + (size_t)(m0 + r) * n + c, (size_t)rows * n, splits);
    };
    finish_group<R>(sum, svh, bias, out, out_dtype, m0, block_rows, group_col, stride_out, warps);
}
