// EXL3 linear on mma.sync m16n8k16: lane l decodes tile positions 8l..8l+7, which are its B fragments.
// Compile-time parameters (-D): K2 = 2K, CB (0 3inst, 1 mcg, 2 mul1), MT m16 tiles per block, NT n16 tiles per
// warp, PF k-tiles of trellis words prefetched per warp, WARPS warps per block, FUSE_IN (rotate x here).
// Each block writes part[split, row, col] (fp32, its k range); the last block of a 128-column group to arrive
// sums the splits in order and applies the output Hadamard, svh and bias: out = Hn(sum) * svh + bias. With
// CLUSTER_SPLITS the group's splits are one cluster: the same sums, from each block's shared memory.
#include "trellis_core.cuh"

using T = Trellis<K2, CB>;

#ifndef MIN_BLOCKS
#define MIN_BLOCKS 0   // blocks per SM that ptxas must fit the registers for
#endif
#ifndef DEFER_REDUCE
#define DEFER_REDUCE 0   // 1: blocks only store their partials (reduce_splits sums them)
#endif
#ifndef CLUSTER_SPLITS
#define CLUSTER_SPLITS 0   // > 0: the splits of a 128-column group, one cluster (2..16 blocks)
#endif
#ifndef CHAIN
#define CHAIN 0   // 1: a programmatic dependent launch of the stream's previous kernel (sm_90), waiting for it
#endif
#ifndef CHAIN_LATE
#define CHAIN_LATE 0   // 1: a chained kernel lets its dependents launch only as its blocks exit
#endif
#ifndef CHAIN_KT
#define CHAIN_KT 0   // k-tiles of each warp's trellis words asked of L2 before that wait
#endif
#if CLUSTER_SPLITS
#define MMA_CLUSTER __cluster_dims__(1, CLUSTER_SPLITS, 1)
#else
#define MMA_CLUSTER
#endif

// Every block of the cluster has arrived here (its earlier shared-memory writes visible to the others).
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// 4 fp32 at shared address `local` of cluster block `rank` (the same variable in that block).
__device__ __forceinline__ float4 load_cluster(u32 local, int rank) {
    u32 remote;
    float4 q;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
    asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(q.x), "=f"(q.y), "=f"(q.z), "=f"(q.w) : "r"(remote) : "memory");
    return q;
}

// xh [rows, k] fp16 = Hn128(x * suh) blockwise, with the arithmetic of trellis_mma's FUSE_IN staging (same bytes).
// One warp per (row, 128 inputs); blocks of 4 warps.
extern "C" __global__ void __launch_bounds__(128)
rotate_input(const unsigned short* __restrict__ x, int x_bf16, const unsigned short* __restrict__ suh,
             unsigned short* __restrict__ xh, int k, int stride_x) {
#if __CUDA_ARCH__ >= 900
#if CHAIN
    asm volatile("griddepcontrol.wait;" ::: "memory");   // a chained launch: the previous kernel may write x, xh
#endif
#if !(CHAIN && CHAIN_LATE)
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");   // a trellis_ws launched early may start
#endif
#endif
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

// The output of one 128-column group (blockIdx.x), rows [m0, m0 + rows_per_block) with m0 = blockIdx.y *
// rows_per_block, from the split partials in split order: the bytes of a last arrival's reduce_group, spread over
// many blocks (for kernels that leave the reduction to it).
extern "C" __global__ void __launch_bounds__(128)
reduce_splits(const float* __restrict__ part, const unsigned short* __restrict__ svh,
              const unsigned short* __restrict__ bias, void* __restrict__ out, int out_dtype, int rows, int n,
              int stride_out, int splits, int rows_per_block) {
    const int m0 = blockIdx.y * rows_per_block, group_col = blockIdx.x * 128;
    if (threadIdx.x < 32) {   // the epilogue's vectors, asked of L2 while the first splits load
        prefetch_l2(svh + group_col, 256, threadIdx.x);
        prefetch_l2(bias != nullptr ? bias + group_col : nullptr, 256, threadIdx.x);
    }
#if CHAIN && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
    reduce_group<1, 4, true>(part, svh, bias, out, out_dtype, rows, n, m0, min(rows_per_block, rows - m0), group_col,
                             stride_out, splits, 4);
}

extern "C" __global__ void __launch_bounds__(WARPS * 32, MIN_BLOCKS) MMA_CLUSTER
trellis_mma(const unsigned short* __restrict__ x, int x_bf16, const unsigned short* __restrict__ suh,
            const u32* __restrict__ words, float* __restrict__ part, const unsigned short* __restrict__ svh,
            const unsigned short* __restrict__ bias, void* __restrict__ out, int out_dtype, int* __restrict__ counters,
            int rows, int n, int tiles_n, int ktiles_total, int ktiles_per_split, int stride_x, int stride_out,
            int splits) {
    TRACE_BEGIN;
    __shared__ __align__(16) unsigned short xs[16 * MT * XS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int split = blockIdx.y;
    const int m0 = blockIdx.z * 16 * MT;
    const int block_rows = min(16 * MT, rows - m0);
    const int kt0 = split * ktiles_per_split;
    const int kt1 = min(kt0 + ktiles_per_split, ktiles_total);
    const int jt0 = (blockIdx.x * WARPS + warp) * NT;
    constexpr int BLOCK_COLS = WARPS * NT * 16;
    const int group_col = (blockIdx.x * BLOCK_COLS) / 128 * 128;
    if (warp == WARPS - 1) {
        prefetch_l2(svh + group_col, 256, lane);
        prefetch_l2(bias != nullptr ? bias + group_col : nullptr, 256, lane);
    }
#if CHAIN && __CUDA_ARCH__ >= 900
    // Before the wait only L2 prefetches (of weights): nothing here reads what the previous kernel may write.
#pragma unroll
    for (int kt = kt0; kt < min(kt0 + CHAIN_KT, kt1); kt++)
        prefetch_l2_lines(words + ((size_t)kt * tiles_n + jt0) * T::WT, NT * T::WT * 4, lane);
    if (FUSE_IN && warp == 0) prefetch_l2_lines(suh + kt0 * 16, CHUNK * 16 * 2, lane);
    asm volatile("griddepcontrol.wait;" ::: "memory");
    // The next such launch may start once this grid runs, not before: waiting grids would pile up on the SMs.
    if (!CHAIN_LATE) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif

    float acc[MT][NT][2][4];
    zero_acc(acc);
    mma_mainloop<K2, CB, MT, NT, PF>(acc, words, tiles_n, jt0, kt0, kt1, (block_rows + 15) / 16, xs, [&](int c0) {
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
        if (c0 == kt0) TRACE_MARK(1);
    });
#if CLUSTER_SPLITS
    static_assert(BLOCK_COLS == 128, "a cluster's blocks are the splits of one 128-column group");
    // Block `split` (its cluster rank) sums rows split, split + CLUSTER_SPLITS, ... over the cluster's partials, in
    // split order (the bytes of reduce_group), and writes them: finish_group over rows strided by the cluster size.
    __shared__ __align__(16) float red[16 * MT * 128];
    {
        const int g = lane >> 2, t4 = lane & 3;
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int half = 0; half < 2; half++)
#pragma unroll
                for (int nt = 0; nt < NT; nt++)
#pragma unroll
                    for (int h = 0; h < 2; h++) {
                        const int r = mt * 16 + g + 8 * half, col = (warp * NT + nt) * 16 + h * 8 + 2 * t4;
                        *reinterpret_cast<float2*>(red + r * 128 + col) =
                            make_float2(acc[mt][nt][h][2 * half], acc[mt][nt][h][2 * half + 1]);
                    }
    }
    TRACE_MARK(2);
    cluster_sync();
    TRACE_MARK(3);
    const u32 red_lane = (u32)__cvta_generic_to_shared(red + 4 * lane);
    const int my_rows = (block_rows - split + CLUSTER_SPLITS - 1) / CLUSTER_SPLITS;
    const size_t first = (size_t)(m0 + split) * stride_out * (out_dtype == 2 ? 4 : 2);
    auto sum = [&](float (&v)[4], int i) {
        const u32 row = red_lane + (u32)((split + i * CLUSTER_SPLITS) * 128 * 4);
#pragma unroll
        for (int s = 0; s < CLUSTER_SPLITS; s++) {
            const float4 q = load_cluster(row, s);
            v[0] += q.x; v[1] += q.y; v[2] += q.z; v[3] += q.w;
        }
    };
    finish_group<1>(sum, svh, bias, reinterpret_cast<char*>(out) + first, out_dtype, 0, my_rows, group_col,
                    stride_out * CLUSTER_SPLITS, WARPS);
    cluster_sync();   // every block's partials stay in its shared memory until the whole cluster has read them
    TRACE_MARK(4);
    TRACE_PRINT(0);
#else
    store_partials(acc, part + ((size_t)split * rows + m0) * n, n, block_rows, jt0);
    TRACE_MARK(2);
    if (DEFER_REDUCE) return;

    // The last block of this (row block, 128 columns) to finish reduces the splits and writes the output.
    if (!last_arrival(counters + blockIdx.z * (n / 128) + group_col / 128, splits * (128 / BLOCK_COLS))) {
        TRACE_MARK(3);
        TRACE_PRINT(0);
        return;
    }
    TRACE_MARK(3);
    // Batched split loads at one m16 tile only: with them, ptxas gives the 2- to 8-tile mainloops fewer registers.
    reduce_group<MT, MT == 1 ? 4 : 1, true>(part, svh, bias, out, out_dtype, rows, n, m0, block_rows, group_col,
                                            stride_out, splits, WARPS);
    TRACE_MARK(4);
    TRACE_PRINT(0);
#endif
}
