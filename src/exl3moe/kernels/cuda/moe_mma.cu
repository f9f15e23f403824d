// Routed EXL3 experts on mma.sync for route blocks of up to 16 MT rows, driven by the MoE tables (ABI 1).
// Compile-time (-D): MT m16 tiles per route block, WARPS warps of NT n16 tiles (WARPS NT = 8: 128 columns per
// block), PF prefetched k-tiles. The prelude defines DISPATCH_GATE_UP(ACC, WORDS, KEY) / DISPATCH_DOWN and the
// STAGE_ forms: switches over 4 x 2K + codebook for the layer's (or the stages') formats, each running
// mma_mainloop of one format.
// gate/up: grid (route block, 2 x I / 128, splits); block (b, 2 c + p) computes projection p (0 gate, 1 up) for
// I columns [128 c, 128 c + 128) over its hidden split, plus scale x residual of every stage with a nonzero
// scale; the last of the 2 x splits arrivals applies both output Hadamards, svh and bias, the activation,
// down's suh and input Hadamard, and stores h_rot[pos] fp16.
// down: grid (route block, H / 128, splits); the last arrival writes y[slot] = Hn(sum) * svh + bias, fp32.
// STAGE_BLOCKS (moe_route.cuh): the stages' passes in blocks of their own, a second half of each grid's z.
// WS (sm_90a, 128-row route blocks, pre-rotated inputs, WARPS 24): a module of gate/up alone, its mainloop
// warp-specialized on trellis_ws.cuh with producers decoding through the prelude's WS_PRODUCE_GATE_UP switch; the
// epilogue is the same. Parts: moe_route.cuh, moe_ws_items.cuh, moe_rotate.cuh, moe_epilogue.cuh, moe_ws_kernels.cuh.
#include "trellis_core.cuh"
#ifndef WS
#define WS 0
#endif
#if WS
#include "trellis_ws.cuh"
static_assert(WARPS * 32 == WS_THREADS, "a warp-specialized block is its producers and consumers");
#define KERNEL_BOUNDS __launch_bounds__(WARPS * 32, 1)   // one block per SM: setmaxnreg needs the entry count
#else
#ifndef MIN_BLOCKS
#define MIN_BLOCKS 0                                   // blocks per SM that ptxas must fit the registers for
#endif
#define KERNEL_BOUNDS __launch_bounds__(WARPS * 32, MIN_BLOCKS)
#endif

#ifndef X_MAP_PARAM
#define X_MAP_PARAM
#endif

#include "moe_route.cuh"
#include "moe_ws_items.cuh"
#include "moe_rotate.cuh"
#include "moe_epilogue.cuh"
#if WS
static_assert(ROUTE_ROWS == WS_ROWS, "a route block is a warp-specialized block's rows");
#endif

// mma.sync kernels run route blocks of their m16 tiles (a module of 192-row blocks has moe_rotate_input alone).
#define MMA_ROUTE (!WS && ROUTE_ROWS == 16 * MT)
#if MMA_ROUTE || defined(WS_PRODUCE_GATE_UP)
extern "C" __global__ void KERNEL_BOUNDS
moe_gate_up_mma(const unsigned short* __restrict__ x, int x_bf16, int stride_x, const int* __restrict__ block_expert,
                const int* __restrict__ block_start, const int* __restrict__ offsets,
                const int* __restrict__ sorted_slots, int top_k, const long long* __restrict__ trellis_addr,
                const long long* __restrict__ suh_addr, const long long* __restrict__ svh_addr,
                const int* __restrict__ k2, const int* __restrict__ codebook, int num_stages,
                const long long* __restrict__ stage_addr, const int* __restrict__ stage_k2,
                const int* __restrict__ stage_codebook, const float* __restrict__ stage_scale,
                const float* __restrict__ bias, int num_experts, int hidden, int inter, float* __restrict__ part,
                int capacity, unsigned short* __restrict__ h_rot, int* __restrict__ counters, int ktiles_per_split,
                int splits, int activation, int has_limit, float limit, const unsigned short* __restrict__ x_rot,
                int ids_64 X_MAP_PARAM) {
    TRACE_BEGIN;
    let_dependents_launch();
    const PrerequisiteOnExit chain{(EARLY_GATE_UP || CHAIN_ON_EXIT) && blockIdx.x + blockIdx.y + blockIdx.z == 0};
#if !WS
    __shared__ __align__(16) unsigned short xs[BLOCK_M * XS];
#endif
    const int b = route_block_index(), column = column_block_index();
    int expert, start, nrows;
    if (!route_block(b, block_expert, block_start, offsets, ids_64, num_experts, expert, start, nrows)) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int proj = column & 1, cblock = column >> 1;
    const int index = proj * num_experts + expert;
    const unsigned short* suh = reinterpret_cast<const unsigned short*>(suh_addr[index]);
    const float scale0 = first_stage_scale(num_stages, index, stage_scale);
    const StageWords stage_words = first_stage_words(num_stages, index, stage_addr, stage_k2, stage_scale, warp);
    const SplitPass sp = split_pass(splits);
    const int kt0 = sp.split * ktiles_per_split, kt1 = min(kt0 + ktiles_per_split, hidden / 16);
    const size_t split_stride = (size_t)2 * capacity * inter;
    if (sp.stages && !stage_active(index, 3 * num_experts, num_stages, stage_scale)) return;   // nothing to add
#if !WS && !PRE_ROTATED && SUH_PREFETCH
    // The input scales of the block's k range, asked of L2 before the weights: every chunk's staging reads them.
    if (warp == 0) prefetch_l2_lines(suh + kt0 * 16, (kt1 - kt0) * 16 * 2, lane);
#endif
#if WS
    extern __shared__ __align__(16) unsigned char smem[];
    const WsShared sh(smem);
    ws_trace(0);
    const int tiles_n = inter / 16, jt = cblock * 8 + producer_column(warp);
    ws_mainloop(sh, X_ROWS(x_rot, (size_t)proj * capacity, hidden), start, nrows, kt0, kt1,
                reinterpret_cast<const u32*>(trellis_addr[index]), k2[index] * 4 + codebook[index], index,
                3 * num_experts, num_stages, stage_addr, stage_k2, stage_codebook, stage_scale,
                [&](const u32* words, int key, u32 cursor) { WS_PRODUCE_GATE_UP(words, key, cursor) },
                [&](const WsAcc& acc, int row0) {
                    if (row0 < nrows)
                        store_partials(acc, part + sp.partial * split_stride +
                                       ((size_t)proj * capacity + start + row0) * inter, inter, nrows - row0,
                                       cblock * 8);
                });
    ws_trace(100);
    ws_trace_print();
#else
    const int jt0 = cblock * 8 + warp * NT, tiles_n = inter / 16, mtiles = (nrows + 15) / 16;
    if (DIRECT_ROUTE && warp == WARPS - 1) {   // the epilogue's vectors of this column block
        const int col = cblock * 128;
        prefetch_l2(reinterpret_cast<const unsigned short*>(svh_addr[expert]) + col, 256, lane);
        prefetch_l2(reinterpret_cast<const unsigned short*>(svh_addr[num_experts + expert]) + col, 256, lane);
        prefetch_l2(reinterpret_cast<const unsigned short*>(suh_addr[2 * num_experts + expert]) + col, 256, lane);
        if (bias != nullptr) {
            prefetch_l2(bias + (size_t)expert * inter + col, 512, lane);
            prefetch_l2(bias + ((size_t)num_experts + expert) * inter + col, 512, lane);
        }
    }

    auto stage = [&](int c0) {
        if (c0 == kt0) prefetch_stage_words(stage_words, inter / 16, kt0, kt1, cblock * 8, lane);
#if PRE_ROTATED
        // x_rot holds this projection's rotated rows (moe_rotate_input): copy the chunk, zero rows past the block's.
        copy_rows(xs, x_rot + (size_t)proj * capacity * hidden, start, nrows, hidden, c0);
#else
        // xs = fp16(Hn128(x[token] * suh)) of this chunk; rows past the block's are zeroed once.
        if (c0 == kt0) {
            for (int v = threadIdx.x; v < (BLOCK_M - nrows) * 128; v += WARPS * 32)
                xs[(nrows + v / 128) * XS + v % 128] = 0;
        }
        for (int r = warp; r < nrows; r += WARPS)
            rotate_chunk(xs + r * XS, x + (size_t)(slot_at(sorted_slots, start + r) / top_k) * stride_x, x_bf16, suh,
                         c0, lane);
#endif
        if (c0 == kt0) TRACE_MARK(1);
    };
    float acc[MT][NT][2][4];
    zero_acc(acc);
    TRACE_MARK(0);
#if UNION_STAGES
    run_passes(acc, reinterpret_cast<const u32*>(trellis_addr[index]), k2[index] * 4 + codebook[index], index,
               3 * num_experts, STAGE_BLOCKS && !sp.stages ? 0 : num_stages, stage_addr, stage_k2, stage_codebook,
               stage_scale, scale0, [&](const u32* words, int key) { DISPATCH_GATE_UP(acc, words, key) },
               sp.stages ? 0 : -1);
#else
    if (!sp.stages)
        DISPATCH_GATE_UP(acc, reinterpret_cast<const u32*>(trellis_addr[index]), k2[index] * 4 + codebook[index])
    if (!STAGE_BLOCKS || sp.stages)
        add_stages(acc, index, 3 * num_experts, num_stages, stage_addr, stage_k2, stage_codebook, stage_scale, scale0,
                   [&](const u32* words, int key) { STAGE_DISPATCH_GATE_UP(acc, words, key) });
#endif
    store_partials(acc, part + sp.partial * split_stride + ((size_t)proj * capacity + start) * inter, inter, nrows,
                   jt0);
#endif
    TRACE_MARK(2);
    const int gate_splits = summed_splits(splits, expert, 3 * num_experts, num_stages, stage_scale);
    const int up_splits = summed_splits(splits, num_experts + expert, 3 * num_experts, num_stages, stage_scale);
#if !DIRECT_ROUTE   // a direct route's arrival is in finish_one_row, after its vectors are read
    if (!last_arrival(counters + b * (inter / 128) + cblock, gate_splits + up_splits)) {
        TRACE_MARK(3);
        TRACE_PRINT(1);
        return;
    }
    TRACE_MARK(3);
#endif

    const int c = cblock * 128 + 4 * lane;
    const unsigned short* gate_svh = reinterpret_cast<const unsigned short*>(svh_addr[expert]);
    const unsigned short* up_svh = reinterpret_cast<const unsigned short*>(svh_addr[num_experts + expert]);
    const unsigned short* down_suh = reinterpret_cast<const unsigned short*>(suh_addr[2 * num_experts + expert]);
    const float* gate_bias = bias != nullptr ? bias + (size_t)expert * inter : nullptr;
    const float* up_bias = bias != nullptr ? bias + ((size_t)num_experts + expert) * inter : nullptr;
#if DIRECT_ROUTE
    if (!finish_one_row(counters + b * (inter / 128) + cblock, gate_splits, up_splits,
                        part + (size_t)start * inter + c, (size_t)capacity * inter, split_stride, gate_svh + c,
                        up_svh + c, down_suh + c, gate_bias ? gate_bias + c : nullptr,
                        up_bias ? up_bias + c : nullptr, activation, has_limit, limit,
                        h_rot + (size_t)start * inter + c)) {
        TRACE_PRINT(1);
        return;
    }
#else
#if PACKED_EPILOGUE_AHEAD
    float gate_scale[4], gate_shift[4], up_scale[4], up_shift[4], down_scale[4];
    load_scales(gate_scale, gate_svh + c);
    load_biases(gate_shift, gate_bias != nullptr ? gate_bias + c : nullptr);
    load_scales(up_scale, up_svh + c);
    load_biases(up_shift, up_bias != nullptr ? up_bias + c : nullptr);
    load_scales(down_scale, down_suh + c);
#endif
    for (int r = warp; r < nrows; r += WARPS) {
        float g[4] = {0.f, 0.f, 0.f, 0.f}, u[4] = {0.f, 0.f, 0.f, 0.f};
        add_splits<SPLIT_BATCH, true>(g, part + (size_t)(start + r) * inter + c, split_stride, gate_splits);
        add_splits<SPLIT_BATCH, true>(u, part + ((size_t)capacity + start + r) * inter + c, split_stride, up_splits);
        hadamard128_warp(g, lane);
        hadamard128_warp(u, lane);
#if PACKED_EPILOGUE_AHEAD
        store_activated([&](int j) { return finished(g[j], gate_scale[j], gate_shift[j]); },
                        [&](int j) { return finished(u[j], up_scale[j], up_shift[j]); },
                        [&](int j) { return down_scale[j]; }, activation, has_limit, limit,
                        h_rot + (size_t)(start + r) * inter + c, lane);
#else
        store_activated([&](int j) { return finished(g[j], gate_svh, gate_bias, c + j); },
                        [&](int j) { return finished(u[j], up_svh, up_bias, c + j); },
                        [&](int j) { return half_to_float(down_suh[c + j]); }, activation, has_limit, limit,
                        h_rot + (size_t)(start + r) * inter + c, lane);
#endif
    }
#endif
    TRACE_MARK(4);
    TRACE_PRINT(1);
}
#endif

#if MMA_ROUTE
extern "C" __global__ void KERNEL_BOUNDS
moe_down_mma(const unsigned short* __restrict__ h_rot, float* __restrict__ y, const int* __restrict__ block_expert,
             const int* __restrict__ block_start, const int* __restrict__ offsets,
             const int* __restrict__ sorted_slots, const long long* __restrict__ trellis_addr,
             const long long* __restrict__ svh_addr, const int* __restrict__ k2, const int* __restrict__ codebook,
             int num_stages, const long long* __restrict__ stage_addr, const int* __restrict__ stage_k2,
             const int* __restrict__ stage_codebook, const float* __restrict__ stage_scale,
             const float* __restrict__ bias, int num_experts, int hidden, int inter, float* __restrict__ part,
             int capacity, int* __restrict__ counters, int ktiles_per_split, int splits, const void* ids, int ids_64,
             const void* weights, int weights_dtype, const float* shared_y, void* out, int out_dtype, int stride_out,
             int* token_counters, int top_k) {
    const Combine combine{ids, ids_64, weights, weights_dtype, shared_y, out, out_dtype, stride_out, token_counters,
                          top_k};
    TRACE_BEGIN;
    let_dependents_launch();
    __shared__ __align__(16) unsigned short xs[BLOCK_M * XS];
    const int b = route_block_index(), cblock = column_block_index();
    int expert, start, nrows;
    if (!route_block(b, block_expert, block_start, offsets, combine.ids_64, num_experts, expert, start, nrows)) {
#if DIRECT_ROUTE
        // A slot of an expert that lives elsewhere still counts towards its token's combine.
        wait_for_prerequisite_grid();
        if (split_index() == 0 && !stage_pass())
            combine_token(combine, b / combine.top_k, cblock, y, hidden, num_experts);
#else
        // Block 0 waits even without rows, so that down never completes before gate/up (the stream's next kernels
        // wait for down alone), even in a call whose every id lives elsewhere.
        if (blockIdx.x + blockIdx.y + blockIdx.z == 0) wait_for_prerequisite_grid();
#endif
        return;
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int index = 2 * num_experts + expert;
    const float scale0 = first_stage_scale(num_stages, index, stage_scale);
    const StageWords stage_words = first_stage_words(num_stages, index, stage_addr, stage_k2, stage_scale, warp);
    const SplitPass sp = split_pass(splits);
    const int kt0 = sp.split * ktiles_per_split, kt1 = min(kt0 + ktiles_per_split, inter / 16);
    const size_t split_stride = (size_t)capacity * hidden;
    if (sp.stages && !stage_active(index, 3 * num_experts, num_stages, stage_scale)) {
        // No active stage: nothing to add. Block 0 still waits, as a block without rows does.
        if (blockIdx.x + blockIdx.y + blockIdx.z == 0) wait_for_prerequisite_grid();
        return;
    }
    const int jt0 = cblock * 8 + warp * NT, tiles_n = hidden / 16, mtiles = (nrows + 15) / 16;

    auto stage = [&](int c0) {   // h_rot rows: rotated input, once gate/up has written them
        if (c0 == kt0) {
            prefetch_stage_words(stage_words, tiles_n, kt0, kt1, cblock * 8, lane);
            wait_for_prerequisite_grid();
        }
        copy_rows(xs, h_rot, start, nrows, inter, c0);
        if (c0 == kt0) TRACE_MARK(1);
    };
    float acc[MT][NT][2][4];
    zero_acc(acc);
    TRACE_MARK(0);
#if UNION_STAGES
    run_passes(acc, reinterpret_cast<const u32*>(trellis_addr[index]), k2[index] * 4 + codebook[index], index,
               3 * num_experts, STAGE_BLOCKS && !sp.stages ? 0 : num_stages, stage_addr, stage_k2, stage_codebook,
               stage_scale, scale0, [&](const u32* words, int key) { DISPATCH_DOWN(acc, words, key) },
               sp.stages ? 0 : -1);
#else
    if (!sp.stages)
        DISPATCH_DOWN(acc, reinterpret_cast<const u32*>(trellis_addr[index]), k2[index] * 4 + codebook[index])
    if (!STAGE_BLOCKS || sp.stages)
        add_stages(acc, index, 3 * num_experts, num_stages, stage_addr, stage_k2, stage_codebook, stage_scale, scale0,
                   [&](const u32* words, int key) { STAGE_DISPATCH_DOWN(acc, words, key) });
#endif
    store_partials(acc, part + sp.partial * split_stride + (size_t)start * hidden, hidden, nrows, jt0);
    TRACE_MARK(2);
    const int down_splits = summed_splits(splits, index, 3 * num_experts, num_stages, stage_scale);
#if DIRECT_ROUTE
    // A direct route's one row: its vectors are read before the arrival, its token's combine inputs before the
    // combine's.
    const int c = cblock * 128 + 4 * lane, token = b / combine.top_k;
    float scale[4], shift[4];
    load_scales(scale, reinterpret_cast<const unsigned short*>(svh_addr[index]) + c);
    load_biases(shift, bias != nullptr ? bias + (size_t)expert * hidden + c : nullptr);
    if (!last_arrival(counters + b * (hidden / 128) + cblock, down_splits)) {
        TRACE_PRINT(2);
        return;
    }
    if (warp == 0) {
        float v[4] = {0.f, 0.f, 0.f, 0.f};
        add_splits<SPLIT_BATCH, true>(v, part + (size_t)start * hidden + c, split_stride, down_splits);
        hadamard128_warp(v, lane);
#pragma unroll
        for (int j = 0; j < 4; j++) y[(size_t)start * hidden + c + j] = v[j] * INV_SQRT_128 * scale[j] + shift[j];
    }
    TRACE_MARK(4);
    combine_token(combine, token, cblock, y, hidden, num_experts);
#else
    if (!last_arrival(counters + b * (hidden / 128) + cblock, down_splits)) {
        TRACE_MARK(3);
        TRACE_PRINT(2);
        return;
    }
    TRACE_MARK(3);

    const int c = cblock * 128 + 4 * lane;
    const unsigned short* svh = reinterpret_cast<const unsigned short*>(svh_addr[index]);
    const float* down_bias = bias != nullptr ? bias + (size_t)expert * hidden : nullptr;
#if PACKED_EPILOGUE_AHEAD
    float scale[4], shift[4];
    load_scales(scale, svh + c);
    load_biases(shift, down_bias != nullptr ? down_bias + c : nullptr);
#endif
    for (int r = warp; r < nrows; r += WARPS) {
        float v[4] = {0.f, 0.f, 0.f, 0.f};
        add_splits<SPLIT_BATCH, true>(v, part + (size_t)(start + r) * hidden + c, split_stride, down_splits);
        hadamard128_warp(v, lane);
        const size_t slot = slot_at(sorted_slots, start + r);
#pragma unroll
        for (int j = 0; j < 4; j++)
#if PACKED_EPILOGUE_AHEAD
            y[slot * hidden + c + j] = v[j] * INV_SQRT_128 * scale[j] + shift[j];
#else
            y[slot * hidden + c + j] = v[j] * INV_SQRT_128 * half_to_float(svh[c + j]) + bias_at(down_bias, c + j);
#endif
    }
    TRACE_MARK(4);
#endif
    TRACE_MARK(5);
    TRACE_PRINT(2);
}
#endif

#include "moe_ws_kernels.cuh"
