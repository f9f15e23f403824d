// EXL3 linear for blocks of 128 rows on trellis_ws.cuh: the same bytes as trellis_mma (same products in the same
// order, the same split partials). A block runs `splits_per_block` consecutive splits; one that runs all of them
// keeps their sum in shared memory. Compile-time (-D): K2, CB, PAIR_SCALAR and trellis_ws.cuh's.
#include "trellis_ws.cuh"
static_assert(WS_ROWS == 128, "the linear's blocks are 128 rows");

constexpr int TOTAL_STRIDE = 136;                     // row stride of the running sum: conflict-free float2 access
constexpr int TOTAL_FLOATS = WS_ROWS * TOTAL_STRIDE;   // a block running every split: the running fp32 sum
#ifndef DEFER_REDUCE
#define DEFER_REDUCE 0   // 1: blocks that do not run every split only store their partials (reduce_splits sums them)
#endif
#ifndef TOTAL_BATCH
#define TOTAL_BATCH 4   // running-sum elements a consumer thread reads before it writes them back
#endif

extern "C" __global__ void __launch_bounds__(WS_THREADS, 1)
trellis_ws(const unsigned short* __restrict__ x, const u32* __restrict__ words, float* __restrict__ part,
           const unsigned short* __restrict__ svh, const unsigned short* __restrict__ bias, void* __restrict__ out,
           int out_dtype, int* __restrict__ counters, int rows, int n, int tiles_n, int ktiles_total,
           int ktiles_per_split, int stride_x, int stride_out, int splits, int splits_per_block X_MAP_PARAM) {
    extern __shared__ __align__(16) unsigned char smem[];
    const WsShared sh(smem);
    float* total = reinterpret_cast<float*>(sh.extra);
    // One block per (128 columns, 128 rows) sums the splits itself, in split order as reduce_group does.
    const bool whole = splits_per_block >= splits;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int m0 = blockIdx.z * WS_ROWS, block_rows = min(WS_ROWS, rows - m0);
    const int split0 = blockIdx.y * splits_per_block, split1 = min(split0 + splits_per_block, splits);
    const int kt_begin = split0 * ktiles_per_split, kt_end = min(split1 * ktiles_per_split, ktiles_total);

    ws_trace(0);
    if (warp < PRODUCERS) {
        role_registers<false, true>();
        produce<K2, CB>(sh.ring, sh.full, sh.empty, words, tiles_n, blockIdx.x * WS_TILES + producer_column(warp),
                        kt_begin, kt_end, warp, 0);
        ws_trace(99);
        role_registers<false, false>();
    } else {
        role_registers<true, true>();
        const int row0 = consumer_row0(), my_rows = block_rows - row0, jt0 = blockIdx.x * WS_TILES;
        Consumer consumer(X_ROWS(x, 0, stride_x), sh.xs, sh.ring, sh.x_full, m0, block_rows);
        WsAcc acc;
        zero_acc(acc);
        // A launch early after rotate_input (programmatic) reads x once that grid is done; else a no-op.
        asm volatile("griddepcontrol.wait;" ::: "memory");
        consumer.stage_first(kt_begin);
        for (int split = split0; split < split1; split++) {
            const int kt0 = split * ktiles_per_split, kt1 = min(kt0 + ktiles_per_split, ktiles_total);
            consumer.run(acc, sh.full, sh.empty, kt0, kt1, kt1 < kt_end ? kt1 : -1);
            if (whole) {
                // total = ((0 + p0) + p1) + ...: each thread adds its own elements, where store_partials puts them,
                // reading TOTAL_BATCH of them before writing any (a read after each write would wait on it).
                const int g = lane >> 2, t4 = lane & 3;
                auto at = [&](int e) -> float2& {   // element e = 4 nt + 2 h + half
                    const int r = row0 + g + 8 * (e & 1), col = (e >> 2) * 16 + ((e >> 1) & 1) * 8 + 2 * t4;
                    return *reinterpret_cast<float2*>(total + r * TOTAL_STRIDE + col);
                };
#pragma unroll
                for (int e0 = 0; e0 < 32; e0 += TOTAL_BATCH) {
                    float2 before[TOTAL_BATCH];
#pragma unroll
                    for (int e = 0; e < TOTAL_BATCH; e++)
                        before[e] = split == split0 ? make_float2(0.f, 0.f) : at(e0 + e);
#pragma unroll
                    for (int e = 0; e < TOTAL_BATCH; e++) {
                        const float* a = acc[0][(e0 + e) >> 2][((e0 + e) >> 1) & 1] + 2 * ((e0 + e) & 1);
                        at(e0 + e) = make_float2(before[e].x + a[0], before[e].y + a[1]);
                    }
                }
            } else if (my_rows > 0) {
                store_partials(acc, part + ((size_t)split * rows + m0 + row0) * n, n, my_rows, jt0);
            }
            zero_acc(acc);
        }
        ws_trace(99);
        role_registers<true, false>();
    }
    constexpr int WARPS_ALL = PRODUCERS + CONSUMERS, R = (WS_ROWS + WARPS_ALL - 1) / WARPS_ALL;   // one pass of rows
    if (whole) {
        __syncthreads();
        auto sum = [&](float (&v)[4], int r) {
            const float4 q = *reinterpret_cast<const float4*>(total + r * TOTAL_STRIDE + 4 * lane);
            v[0] += q.x; v[1] += q.y; v[2] += q.z; v[3] += q.w;
        };
        finish_group<R>(sum, svh, bias, out, out_dtype, m0, block_rows, blockIdx.x * 128, stride_out, WARPS_ALL);
        ws_trace(100);
        ws_trace_print();
        return;
    }
    if (DEFER_REDUCE || !last_arrival(counters + blockIdx.z * (n / 128) + blockIdx.x, gridDim.y)) return;
    reduce_group<R, 4>(part, svh, bias, out, out_dtype, rows, n, m0, block_rows, blockIdx.x * 128, stride_out, splits,
                    WARPS_ALL);
}
