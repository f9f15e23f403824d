// moe_mma.cu's persistent warp-specialized kernels: moe_gate_up_ws (opt-in) and moe_down_ws.
#pragma once
#if WS && defined(WS_PRODUCE_GATE_UP) && !X_TMA && WS_BLOCK_ROWS == 128
// Gate and up of every (route block, 128 columns) item of a single-split plan, persistent like moe_down_ws: the
// consumers run gate, keep its finished values (Hn(sum) * svh + bias) in shared memory, run up, and write
// h_rot[pos] = fp16(Hn(act(gate, up) * down's suh) / sqrt(128)): the bytes of moe_gate_up_mma's last arrival.

extern "C" __global__ void KERNEL_BOUNDS
moe_gate_up_ws(const int* __restrict__ block_expert, const int* __restrict__ block_start,
               const int* __restrict__ offsets, const long long* __restrict__ trellis_addr,
               const long long* __restrict__ suh_addr, const long long* __restrict__ svh_addr,
               const int* __restrict__ k2, const int* __restrict__ codebook, int num_stages,
               const long long* __restrict__ stage_addr, const int* __restrict__ stage_k2,
               const int* __restrict__ stage_codebook, const float* __restrict__ stage_scale,
               const float* __restrict__ bias, int num_experts, int hidden, int inter, int capacity,
               unsigned short* __restrict__ h_rot, int activation, int has_limit, float limit,
               const unsigned short* __restrict__ x_rot, int blocks) {
    extern __shared__ __align__(16) unsigned char smem[];
    const WsShared sh(smem);
    const int warp = threadIdx.x >> 5, cblocks = inter / 128, items = blocks * cblocks;
    const int kt0 = 0, kt1 = hidden / 16, tiles_n = inter / 16, stride = 3 * num_experts;
    ws_roles(
        [&](u32& cursor) {
            // (item, projection) pairs in the consumers' order, one loop so that little stays live across the decode
            for (int q = 2 * blockIdx.x; q < 2 * items; q += (q & 1) ? 2 * gridDim.x - 1 : 1) {
                const int item = q >> 1;
                int expert, start, nrows;
                if (!route_block(item / cblocks, block_expert, block_start, offsets, 0, num_experts, expert, start,
                                 nrows))
                    break;   // the unused route blocks are the table's last
                const int jt = (item % cblocks) * WS_TILES + producer_column(warp);
                const int index = (q & 1) * num_experts + expert;
                ws_produce_index(trellis_addr, k2, codebook, index, stride, num_stages, stage_addr, stage_k2,
                                 stage_codebook, stage_scale, kt1 / STAGE_KT, cursor,
                                 [&](const u32* words, int key, u32 at) { WS_PRODUCE_GATE_UP(words, key, at) });
            }
        },
        [&] {
            const int lane = threadIdx.x & 31, row0 = consumer_row0() + (lane >> 2), t4 = lane & 3;
            // Element k = 4 (2 nt + h) + e of a consumer thread: gate's in `keep`, up's in the x buffers once both
            // warpgroups are done with them, k-major so each thread reads back only its own.
            float* keep = reinterpret_cast<float*>(sh.extra) + (threadIdx.x - PRODUCERS * 32);
            float* keep_up = reinterpret_cast<float*>(sh.xs) + (threadIdx.x - PRODUCERS * 32);
            constexpr int KEEP_STEP = CONSUMERS * 32;
            Consumer consumer(X_ROWS(x_rot, 0, hidden), sh.xs, sh.ring, sh.x_full, 0, 0);
            WsAcc acc;
            for_each_item(items, cblocks, block_expert, block_start, offsets, num_experts,
                          [&](int expert, int start, int nrows, int item) {
                const int c0 = (item % cblocks) * 128 + 2 * t4;
#pragma unroll 1
                for (int proj = 0; proj < 2; proj++) {
                    const int index = proj * num_experts + expert;
                    consumer.retarget(X_ROWS(x_rot, (size_t)proj * capacity, hidden), sh.xs, start, nrows);
                    ws_consume_item(acc, consumer, sh, kt0, kt1, index, stride, num_stages, stage_scale);
                    hadamard_rows(acc);
                    if (proj == 1) consumers_sync();   // no wgmma of either warpgroup reads the x buffers any more
                    const unsigned short* svh = reinterpret_cast<const unsigned short*>(svh_addr[index]);
                    const float* b = bias != nullptr ? bias + (size_t)index * inter : nullptr;
                    float* dst = proj == 0 ? keep : keep_up;
                    each_element([&](int nt, int h, int e, int k) {
                        const int c = c0 + nt * 16 + h * 8 + (e & 1);
                        dst[k * KEEP_STEP] = acc[0][nt][h][e] * INV_SQRT_128 * half_to_float(svh[c]) + bias_at(b, c);
                    });
                }
                const unsigned short* down_suh =
                    reinterpret_cast<const unsigned short*>(suh_addr[2 * num_experts + expert]);
#pragma unroll 1
                for (int k = 0; k < 64; k++) {
                    const int c = c0 + (k >> 3) * 16 + ((k >> 2) & 1) * 8 + (k & 1);
                    keep[k * KEEP_STEP] =
                        activate(keep[k * KEEP_STEP], keep_up[k * KEEP_STEP], activation, has_limit, limit) *
                        half_to_float(down_suh[c]);
                }
                each_element([&](int nt, int h, int e, int k) { acc[0][nt][h][e] = keep[k * KEEP_STEP]; });
                hadamard_rows<false>(acc);
#pragma unroll
                for (int half = 0; half < 2; half++) {
                    const int r = row0 + 8 * half;
                    if (r >= nrows) continue;
                    unsigned short* dst = h_rot + (size_t)(start + r) * inter;
#pragma unroll
                    for (int nt = 0; nt < 8; nt++)
#pragma unroll
                        for (int h = 0; h < 2; h++) {
                            const int c = c0 + nt * 16 + h * 8;
                            const u32 lo = float_to_half(acc[0][nt][h][2 * half] * INV_SQRT_128);
                            const u32 hi = float_to_half(acc[0][nt][h][2 * half + 1] * INV_SQRT_128);
                            *reinterpret_cast<u32*>(dst + c) = lo | hi << 16;
                        }
                }
                consumers_sync();   // every thread has read its up values before the next item stages x there
            });
        });
}
#endif

#if WS && defined(WS_PRODUCE_DOWN)
constexpr int DOWN_SVH_AHEAD = 4;   // svh pairs moe_down_ws reads ahead of their use
// Down of every (route block, 128 columns) item of a single-split plan, persistent: block i takes items i, i + grid,
// ... (item = route block x H / 128 + column block); producers decode on into the next item while the consumers
// finish one from their accumulators (hadamard_rows), y[slot] = Hn(sum) * svh + bias, fp32: the bytes of
// moe_down_mma's last arrival.
extern "C" __global__ void KERNEL_BOUNDS
moe_down_ws(const unsigned short* __restrict__ h_rot, float* __restrict__ y, const int* __restrict__ block_expert,
            const int* __restrict__ block_start, const int* __restrict__ offsets,
            const int* __restrict__ sorted_slots, const long long* __restrict__ trellis_addr,
            const long long* __restrict__ svh_addr, const int* __restrict__ k2, const int* __restrict__ codebook,
            int num_stages, const long long* __restrict__ stage_addr, const int* __restrict__ stage_k2,
            const int* __restrict__ stage_codebook, const float* __restrict__ stage_scale,
            const float* __restrict__ bias, int num_experts, int hidden, int inter, int blocks X_MAP_PARAM) {
    let_dependents_launch();
    const PrerequisiteOnExit chain{CHAIN_ON_EXIT && blockIdx.x == 0};
    extern __shared__ __align__(16) unsigned char smem[];
    const WsShared sh(smem);
    const int warp = threadIdx.x >> 5, cblocks = hidden / 128, items = blocks * cblocks;
    const int kt0 = 0, kt1 = inter / 16, tiles_n = hidden / 16, stride = 3 * num_experts;
    ws_roles(
        [&](u32& cursor) {
            for_each_item(items, cblocks, block_expert, block_start, offsets, num_experts,
                          [&](int expert, int start, int nrows, int item) {
                const int index = 2 * num_experts + expert, jt = (item % cblocks) * WS_TILES + producer_column(warp);
                ws_produce_index(trellis_addr, k2, codebook, index, stride, num_stages, stage_addr, stage_k2,
                                 stage_codebook, stage_scale, kt1 / STAGE_KT, cursor,
                                 [&](const u32* words, int key, u32 at) { WS_PRODUCE_DOWN(words, key, at) });
            });
        },
        [&] {
            const int lane = threadIdx.x & 31, row0 = consumer_row0() + (lane >> 2), t4 = lane & 3;
            Consumer consumer(X_ROWS(h_rot, 0, inter), sh.xs, sh.ring, sh.x_full, 0, 0);
            WsAcc acc;
            // The first item with rows from `item` on (items if none), its first x chunk staged.
            auto stage_next = [&](int item, int& expert, int& start, int& nrows) {
                for (; item < items; item += gridDim.x)
                    if (route_block(item / cblocks, block_expert, block_start, offsets, 0, num_experts, expert,
                                    start, nrows)) {
                        consumer.retarget(X_ROWS(h_rot, 0, inter), sh.xs, start, nrows);
                        consumer.stage_first(kt0);
                        break;
                    }
                return item;
            };
            int expert, start, nrows;
            for (int item = stage_next(blockIdx.x, expert, start, nrows); item < items;) {
                const int index = 2 * num_experts + expert, c0 = (item % cblocks) * 128 + 2 * t4;
                ws_consume_item(acc, consumer, sh, kt0, kt1, index, stride, num_stages, stage_scale, true);
                // The next item's rows land while this one's finish runs (its first chunk's buffer is free after run).
                int next_expert, next_start, next_nrows;
                const int next = stage_next(item + gridDim.x, next_expert, next_start, next_nrows);
                const unsigned short* svh = reinterpret_cast<const unsigned short*>(svh_addr[index]);
                const float* down_bias = bias != nullptr ? bias + (size_t)expert * hidden : nullptr;
                // svh pair p (columns c0 + 8 p, + 1) read DOWN_SVH_AHEAD pairs before its use, the first ones before
                // the Hadamard: a read between the stores of y waits on its own otherwise.
                u32 pair[16];
                auto read_pair = [&](int p) { pair[p] = __ldg(reinterpret_cast<const u32*>(svh + c0 + 8 * p)); };
#pragma unroll
                for (int p = 0; p < DOWN_SVH_AHEAD; p++) read_pair(p);
                hadamard_rows(acc);
                float* dst[2];
#pragma unroll
                for (int half = 0; half < 2; half++)
                    dst[half] = row0 + 8 * half < nrows ? y + (size_t)sorted_slots[start + row0 + 8 * half] * hidden
                                                        : nullptr;
#pragma unroll
                for (int p = 0; p < 16; p++) {
                    if (p + DOWN_SVH_AHEAD < 16) read_pair(p + DOWN_SVH_AHEAD);
                    const int nt = p >> 1, h = p & 1, c = c0 + 8 * p;
#pragma unroll
                    for (int half = 0; half < 2; half++) {
                        if (dst[half] == nullptr) continue;
                        float o[2];
#pragma unroll
                        for (int j = 0; j < 2; j++)
                            o[j] = acc[0][nt][h][2 * half + j] * INV_SQRT_128 *
                                   half_to_float((unsigned short)(pair[p] >> (16 * j))) + bias_at(down_bias, c + j);
                        *reinterpret_cast<float2*>(dst[half] + c) = make_float2(o[0], o[1]);
                    }
                }
                item = next;
                expert = next_expert;
                start = next_start;
                nrows = next_nrows;
            }
        });
}
#endif
