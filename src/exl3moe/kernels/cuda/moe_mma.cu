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
// WS (sm_90a, 128-row route blocks, pre-rotated inputs, WARPS 24): a module of gate/up alone, its mainloop
// warp-specialized on trellis_ws.cuh with producers decoding through the prelude's WS_PRODUCE_GATE_UP switch; the
// epilogue is the same.
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

constexpr int BLOCK_M = 16 * MT;
constexpr int SPLIT_BATCH = DIRECT_ROUTE ? 4 : 1;   // split loads in flight at once in the epilogues (add_splits)

__device__ __forceinline__ float sigmoid(float x) {
    const float e = expf(-fabsf(x));
    return x >= 0.f ? 1.f / (1.f + e) : e / (1.f + e);
}

// act(g) * u with the clamp of reference.moe: 0 silu, 1 gelu (tanh form).
__device__ __forceinline__ float activate(float g, float u, int activation, int has_limit, float limit) {
    float a = activation == 0 ? g * sigmoid(g) : g * sigmoid(1.5957691216f * (g + 0.044715f * g * g * g));
    if (has_limit) {
        a = fminf(a, limit);
        u = fminf(fmaxf(u, -limit), limit);
    }
    return a * u;
}

#ifndef ROUTE_MAJOR
#define ROUTE_MAJOR 1
#endif
// Grids of gate/up and down: ROUTE_MAJOR puts column blocks along x, so a route block's (one expert's, one format's
// code) run as consecutive blocks; else route blocks along x.
#ifndef SPLIT_INNER
#define SPLIT_INNER 0   // 1 (route-major grids): splits along y and route blocks along z, so a route block runs at once
#endif
static_assert(!SPLIT_INNER || ROUTE_MAJOR, "splits go inside the route blocks of a route-major grid");
__device__ __forceinline__ int route_block_index() {
    return SPLIT_INNER ? blockIdx.z : ROUTE_MAJOR ? blockIdx.y : blockIdx.x;
}
__device__ __forceinline__ int column_block_index() { return ROUTE_MAJOR ? blockIdx.x : blockIdx.y; }
__device__ __forceinline__ int split_index() { return SPLIT_INNER ? blockIdx.y : blockIdx.z; }

// Expert, first sorted position and row count (<= BLOCK_M) of route block b; false for an unused block.
// DIRECT_ROUTE: block b is flat slot b alone (one row at position b) and `block_expert` holds topk_ids (int64
// when ids_64); false for an id outside [0, num_experts).
__device__ __forceinline__ bool route_block(int b, const int* block_expert, const int* block_start, const int* offsets,
                                            int ids_64, int num_experts, int& expert, int& start, int& nrows) {
#if DIRECT_ROUTE
    const long long id = ids_64 ? reinterpret_cast<const long long*>(block_expert)[b] : block_expert[b];
    if (id < 0 || id >= num_experts) return false;
    expert = (int)id;
    start = b;
    nrows = 1;
    return true;
#else
    expert = block_expert[b];
    if (expert < 0) return false;
    start = block_start[b];
    nrows = min(BLOCK_M, offsets[expert + 1] - start);
    return true;
#endif
}

// Flat slot of sorted position pos (a direct route's positions are its slots).
__device__ __forceinline__ int slot_at(const int* sorted_slots, int pos) {
#if DIRECT_ROUTE
    return pos;
#else
    return sorted_slots[pos];
#endif
}

// DIRECT_ROUTE combine: the last of a token's top_k slot blocks to finish 128 columns writes
// out[token] = sum_j w[token, j] y[token top_k + j] (+ shared_y[token]) over them, fp32 in slot order,
// skipping ids outside [0, num_experts) like moe_combine. One column per thread (128 threads).
struct Combine {
    const void* ids;
    int ids_64;
    const void* weights;
    int weights_dtype;  // 0 fp16, 1 bf16, 2 fp32
    const float* shared_y;
    void* out;
    int out_dtype;  // 0 fp16, 1 bf16, 2 fp32
    int stride_out;
    int* counters;  // [tokens, hidden / 128]
    int top_k;
};

__device__ __forceinline__ float load_as_float(const void* p, size_t i, int dtype) {
    if (dtype == 2) return reinterpret_cast<const float*>(p)[i];
    return input_to_float(reinterpret_cast<const unsigned short*>(p)[i], dtype);
}

__device__ __forceinline__ bool slot_is_local(const Combine& cb, size_t slot, int num_experts) {
    const long long id = cb.ids_64 ? reinterpret_cast<const long long*>(cb.ids)[slot]
                                   : reinterpret_cast<const int*>(cb.ids)[slot];
    return id >= 0 && id < num_experts;
}

#ifndef EARLY_LAUNCH
#define EARLY_LAUNCH 0   // 1: down launches while gate/up finishes (programmatic dependent launch, sm_90)
#endif
// gate/up and down let their dependents launch once all of their blocks have started; down waits for gate/up's
// completion (and its memory) before it reads what gate/up wrote. Both are no-ops without EARLY_LAUNCH.
__device__ __forceinline__ void let_dependents_launch() {
#if EARLY_LAUNCH && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void wait_for_prerequisite_grid() {
#if EARLY_LAUNCH && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

#ifndef EARLY_GATE_UP
#define EARLY_GATE_UP 0   // 1 (with EARLY_LAUNCH): gate/up launched early after the previous expert set's down
#endif
// An early gate/up reads nothing its prerequisite writes, but must not complete before it: the kernels after it
// wait for it alone. Block 0 waits for the prerequisite when it leaves, wherever it returns.
struct PrerequisiteOnExit {
    bool wait;
    __device__ __forceinline__ ~PrerequisiteOnExit() {
        if (wait) wait_for_prerequisite_grid();
    }
};

#ifndef SUH_PREFETCH
#define SUH_PREFETCH 0   // 1: gate/up blocks that rotate their inputs ask L2 for their k range's suh first
#endif
#ifndef PACKED_EPILOGUE_AHEAD
#define PACKED_EPILOGUE_AHEAD 0   // 1: packed epilogues read their vectors once, before the row loop
#endif

// A token's first COMBINE_AHEAD routing weights and the ids' locality, and its shared-expert value, read before the
// combine's arrival so that their latency overlaps it (0: each slot's id, then weight, after the arrival).
#ifndef COMBINE_AHEAD
#define COMBINE_AHEAD 0
#endif
constexpr int AHEAD_SLOTS = COMBINE_AHEAD > 0 ? COMBINE_AHEAD : 1;
struct TokenInputs {
    float weight[AHEAD_SLOTS];
    unsigned local;  // bit j: slot j's id is in [0, num_experts)
    float shared;
};

__device__ __forceinline__ TokenInputs token_inputs(const Combine& cb, int token, int cblock, int hidden,
                                                    int num_experts) {
    TokenInputs in{{}, 0u, 0.f};
    long long ids[AHEAD_SLOTS];
    u32 raw[AHEAD_SLOTS];   // weight bits: fp32, or fp16 / bf16 in the low half
#pragma unroll
    for (int j = 0; j < COMBINE_AHEAD; j++) {   // every load first, so that none waits for another
        const size_t slot = (size_t)token * cb.top_k + j;
        if (j < cb.top_k) {
            ids[j] = cb.ids_64 ? reinterpret_cast<const long long*>(cb.ids)[slot]
                               : reinterpret_cast<const int*>(cb.ids)[slot];
            raw[j] = cb.weights_dtype == 2 ? reinterpret_cast<const u32*>(cb.weights)[slot]
                                           : reinterpret_cast<const unsigned short*>(cb.weights)[slot];
        }
    }
#pragma unroll
    for (int j = 0; j < COMBINE_AHEAD; j++)
        if (j < cb.top_k && ids[j] >= 0 && ids[j] < num_experts) {
            in.local |= 1u << j;
            in.weight[j] = cb.weights_dtype == 2 ? __uint_as_float(raw[j])
                                                 : input_to_float((unsigned short)raw[j], cb.weights_dtype);
        }
    if (cb.shared_y != nullptr) in.shared = cb.shared_y[(size_t)token * hidden + cblock * 128 + threadIdx.x];
    return in;
}

__device__ __forceinline__ void combine_token(const Combine& cb, int token, int cblock, const float* y, int hidden,
                                              int num_experts) {
    const TokenInputs in = token_inputs(cb, token, cblock, hidden, num_experts);
    if (!last_arrival(cb.counters + (size_t)token * (hidden / 128) + cblock, cb.top_k)) return;
    const int c = cblock * 128 + threadIdx.x;
    float ys[AHEAD_SLOTS];
#pragma unroll
    for (int j = 0; j < COMBINE_AHEAD; j++)
        if (j < cb.top_k) ys[j] = __ldcg(y + ((size_t)token * cb.top_k + j) * hidden + c);
    float acc = 0.f;
#pragma unroll
    for (int j = 0; j < COMBINE_AHEAD; j++)
        if (in.local >> j & 1u) acc = acc + in.weight[j] * ys[j];
    for (int j = COMBINE_AHEAD; j < cb.top_k; j++) {
        const size_t slot = (size_t)token * cb.top_k + j;
        if (slot_is_local(cb, slot, num_experts))
            acc = acc + load_as_float(cb.weights, slot, cb.weights_dtype) * __ldcg(y + slot * hidden + c);
    }
    if (cb.shared_y != nullptr) acc = acc + in.shared;
    const size_t o = (size_t)token * cb.stride_out + c;
    if (cb.out_dtype == 2) reinterpret_cast<float*>(cb.out)[o] = acc;
    else if (cb.out_dtype == 1) reinterpret_cast<unsigned short*>(cb.out)[o] = float_to_bf16(acc);
    else reinterpret_cast<unsigned short*>(cb.out)[o] = float_to_half(acc);
}

// acc += scale x (xs @ R) for each stage with a nonzero scale at index + s x stride, computed as
// scale x (acc / scale + xs @ R) so no second accumulator is live; run(words, key) runs one mainloop.
template <class Acc, class Run>
__device__ __forceinline__ void add_stages(Acc& acc, int index, int stride, int num_stages,
                                           const long long* __restrict__ addr, const int* __restrict__ k2,
                                           const int* __restrict__ codebook, const float* __restrict__ scale,
                                           Run&& run) {
    for (int s = 0; s < num_stages; s++) {
        const int i = s * stride + index;
        const float f = scale[i];
        if (f == 0.f) continue;
        scale_acc(acc, 1.f / f);
        run(reinterpret_cast<const u32*>(addr[i]), k2[i] * 4 + codebook[i]);
        scale_acc(acc, f);
    }
}

#ifndef UNION_STAGES
#define UNION_STAGES 0   // 1: the base and each stage with a nonzero scale run one switch over both sets of formats
#endif

// The base trellis, then add_stages' sums, as passes of one loop through run(words, key): one mainloop per format
// of the union of the base and stage formats instead of one per format of each (fewer registers, less code).
template <class Acc, class Run>
__device__ __forceinline__ void run_passes(Acc& acc, const u32* base_words, int base_key, int index, int stride,
                                           int num_stages, const long long* __restrict__ addr,
                                           const int* __restrict__ k2, const int* __restrict__ codebook,
                                           const float* __restrict__ scale, Run&& run) {
    for (int s = -1; s < num_stages; s++) {
        const u32* words = base_words;
        int key = base_key;
        float f = 1.f;
        if (s >= 0) {
            const int i = s * stride + index;
            f = scale[i];
            if (f == 0.f) continue;
            words = reinterpret_cast<const u32*>(addr[i]);
            key = k2[i] * 4 + codebook[i];
            scale_acc(acc, 1.f / f);
        }
        run(words, key);
        if (s >= 0) scale_acc(acc, f);
    }
}

// xs[r] = rows[start + r] (fp16, row length `width`) over chunk c0's 128 columns; rows past nrows zeroed.
__device__ __forceinline__ void copy_rows(unsigned short* xs, const unsigned short* rows, int start, int nrows,
                                          int width, int c0) {
    for (int v = threadIdx.x; v < BLOCK_M * 16; v += WARPS * 32) {
        const int r = v >> 4, cc = (v & 15) * 8;
        uint4 val = make_uint4(0, 0, 0, 0);
        if (r < nrows) val = *reinterpret_cast<const uint4*>(rows + (size_t)(start + r) * width + c0 * 16 + cc);
        *reinterpret_cast<uint4*>(xs + r * XS + cc) = val;
    }
}

// dst[0..128) = fp16(Hn128(xr[c] * suh[c]) / sqrt(128)) for the 128 inputs of chunk c0; one warp.
__device__ __forceinline__ void rotate_chunk(unsigned short* dst, const unsigned short* xr, int x_bf16,
                                             const unsigned short* suh, int c0, int lane) {
    const int c = c0 * 16 + 4 * lane;
    float v[4];
#pragma unroll
    for (int j = 0; j < 4; j++) v[j] = input_to_float(xr[c + j], x_bf16) * half_to_float(suh[c + j]);
    hadamard128_warp(v, lane);
    const u32 lo = float_to_half(v[0] * INV_SQRT_128) | (u32)float_to_half(v[1] * INV_SQRT_128) << 16;
    const u32 hi = float_to_half(v[2] * INV_SQRT_128) | (u32)float_to_half(v[3] * INV_SQRT_128) << 16;
    *reinterpret_cast<uint2*>(dst + 4 * lane) = make_uint2(lo, hi);   // dst: a workspace row, 8-byte aligned
}

#if WS
// Producer side of one work item: the trellis at `index` over k-tiles [kt0, kt1), then each stage with a nonzero
// scale, each a ring range further on (per_range stages); cursor ends past the item.
template <class Produce>
__device__ __forceinline__ void ws_produce_item(const u32* words, int key, int index, int stride, int num_stages,
                                                const long long* __restrict__ addr, const int* __restrict__ k2,
                                                const int* __restrict__ codebook, const float* __restrict__ scale,
                                                int per_range, u32& cursor, Produce&& produce) {
    produce(words, key, cursor);
    cursor += per_range;
    for (int s = 0; s < num_stages; s++) {
        const int i = s * stride + index;
        if (scale[i] == 0.f) continue;
        produce(reinterpret_cast<const u32*>(addr[i]), k2[i] * 4 + codebook[i], cursor);
        cursor += per_range;
    }
}

// ws_produce_item for the persistent kernels' items: the base trellis and format read from the layer's tables.
template <class Produce>
__device__ __forceinline__ void ws_produce_index(const long long* __restrict__ trellis_addr,
                                                 const int* __restrict__ base_k2, const int* __restrict__ base_codebook,
                                                 int index, int stride, int num_stages,
                                                 const long long* __restrict__ addr, const int* __restrict__ k2,
                                                 const int* __restrict__ codebook, const float* __restrict__ scale,
                                                 int per_range, u32& cursor, Produce&& produce) {
    ws_produce_item(reinterpret_cast<const u32*>(trellis_addr[index]), base_k2[index] * 4 + base_codebook[index],
                    index, stride, num_stages, addr, k2, codebook, scale, per_range, cursor, produce);
}

// Consumer side of one work item: acc = the consumer's rows of x times the item's trellis over k-tiles [kt0, kt1),
// plus scale x residual of every stage with a nonzero scale, as add_stages computes them.
__device__ __forceinline__ void ws_consume_item(WsAcc& acc, Consumer& consumer, const WsShared& sh, int kt0, int kt1,
                                                int index, int stride, int num_stages,
                                                const float* __restrict__ scale, bool staged = false) {
    zero_acc(acc);
    if (!staged) consumer.stage_first(kt0);   // staged: the caller has staged the item's first chunk
    consumer.run(acc, sh.full, sh.empty, kt0, kt1, -1);
    for (int s = 0; s < num_stages; s++) {
        const float f = scale[s * stride + index];
        if (f == 0.f) continue;
        scale_acc(acc, 1.f / f);
        consumer.stage_first(kt0);
        consumer.run(acc, sh.full, sh.empty, kt0, kt1, -1);
        scale_acc(acc, f);
    }
}

// The warp-specialized mainloop of one (route block, 128 columns, k split): the consumer warps' accumulators of
// rows [start, start + nrows) of x (row length `width`, pre-rotated) over k-tiles [kt0, kt1) go to store(acc, row0)
// (row0: the warp's first row in the block); produce(words, key, cursor) decodes one trellis into the ring. Both
// roles leave with the block's entry register count.
template <class Produce, class Store>
__device__ __forceinline__ void ws_mainloop(const WsShared& sh, const unsigned short* x, int start, int nrows,
                                            int width, int kt0, int kt1, const u32* words, int key, int index,
                                            int stride, int num_stages, const long long* __restrict__ addr,
                                            const int* __restrict__ k2, const int* __restrict__ codebook,
                                            const float* __restrict__ scale, Produce&& produce, Store&& store) {
    ws_roles(
        [&](u32& cursor) {
            ws_produce_item(words, key, index, stride, num_stages, addr, k2, codebook, scale, (kt1 - kt0) / STAGE_KT,
                            cursor, produce);
        },
        [&] {
            WsAcc acc;
            Consumer consumer(x, sh.xs, sh.ring, start, nrows, width);
            ws_consume_item(acc, consumer, sh, kt0, kt1, index, stride, num_stages, scale);
            store(acc, consumer_row0());
        });
}

// f(expert, start, nrows, item) for each item of this block that has rows: items blockIdx.x + gridDim.x j of
// `items` (route block x column blocks); a persistent kernel's producers and consumers walk the same ones.
template <class F>
__device__ __forceinline__ void for_each_item(int items, int cblocks, const int* __restrict__ block_expert,
                                              const int* __restrict__ block_start, const int* __restrict__ offsets,
                                              int num_experts, F&& f) {
    for (int item = blockIdx.x; item < items; item += gridDim.x) {
        int expert, start, nrows;
        if (route_block(item / cblocks, block_expert, block_start, offsets, 0, num_experts, expert, start, nrows))
            f(expert, start, nrows, item);
    }
}
#endif

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

// Eight fp16 / bf16 values from p as floats: one 16-byte load when `vector` (p 16-byte aligned).
__device__ __forceinline__ void load8(float* out, const unsigned short* p, bool vector, int is_bf16) {
    unsigned short u[8];
    if (vector) {
        const uint4 w = *reinterpret_cast<const uint4*>(p);
        const u32 words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int j = 0; j < 8; j++) u[j] = (unsigned short)(words[j >> 1] >> (16 * (j & 1)));
    } else {
#pragma unroll
        for (int j = 0; j < 8; j++) u[j] = p[j];
    }
#pragma unroll
    for (int j = 0; j < 8; j++) out[j] = input_to_float(u[j], is_bf16);
}

// x_rot[p, pos] = gate (p 0) or up (p 1) rotated input of every routed position: grid (route block, 2,
// BLOCK_M / ROTATE_ROWS); each quad of lanes rotates one (row, 128 inputs) item of the block's ROTATE_ROWS rows.
// The same bytes gate/up computes itself without PRE_ROTATED. flags: bit 0 bf16 x, bit 1 x and suh 16-byte aligned.
constexpr int ROTATE_ROWS = 8;

extern "C" __global__ void KERNEL_BOUNDS
moe_rotate_input(const unsigned short* __restrict__ x, int flags, int stride_x,
                 const int* __restrict__ block_expert, const int* __restrict__ block_start,
                 const int* __restrict__ offsets, const int* __restrict__ sorted_slots, int top_k,
                 const long long* __restrict__ suh_addr, int num_experts, int hidden, int capacity,
                 unsigned short* __restrict__ x_rot) {
    int expert, start, nrows;
    if (!route_block(blockIdx.x, block_expert, block_start, offsets, 0, num_experts, expert, start, nrows)) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, proj = blockIdx.y, q = lane & 3;
    const int r0 = blockIdx.z * ROTATE_ROWS, rows = min(ROTATE_ROWS, nrows - r0), chunks = hidden / 128;
    const int x_bf16 = flags & 1;
    const bool vector = flags & 2;
    const unsigned short* suh = reinterpret_cast<const unsigned short*>(suh_addr[proj * num_experts + expert]);
    unsigned short* dst = x_rot + ((size_t)proj * capacity + start + r0) * hidden;
    // slot / top_k as a multiply-high: exact for slots below 2^32 / top_k
    const u32 magic = top_k > 1 ? 0xffffffffu / (u32)top_k + 1u : 0u;
    // A warp takes eight items at a time (one per quad); quads past the last item redo it and store nothing, so
    // every lane reaches the shuffles.
    for (int base = 8 * warp; base < rows * chunks; base += 8 * WARPS) {
        const int item = min(base + (lane >> 2), rows * chunks - 1), r = item / chunks;
        const int c = (item % chunks) * 128 + 8 * q;   // the quad's pieces of 64 bytes are contiguous
        const u32 slot = sorted_slots[start + r0 + r], token = magic ? __umulhi(slot, magic) : slot;
        const unsigned short* xr = x + (size_t)token * stride_x + c;
        float v[32];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            float s[8];
            load8(v + 8 * i, xr + 32 * i, vector, x_bf16);
            load8(s, suh + c + 32 * i, vector, 0);
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
                    w[j] = float_to_half(v[8 * i + 2 * j] * INV_SQRT_128) |
                           (u32)float_to_half(v[8 * i + 2 * j + 1] * INV_SQRT_128) << 16;
                *reinterpret_cast<uint4*>(out + 32 * i) = make_uint4(w[0], w[1], w[2], w[3]);
            }
        }
    }
}

#endif

__device__ __forceinline__ float bias_at(const float* bias, size_t i) { return bias != nullptr ? bias[i] : 0.f; }

// A lane's 4 columns of an epilogue vector, loaded ahead of the arrival: fp16 scales, and fp32 biases (0 when none).
__device__ __forceinline__ void load_scales(float (&v)[4], const unsigned short* p) {
#pragma unroll
    for (int j = 0; j < 4; j++) v[j] = half_to_float(__ldg(p + j));
}

__device__ __forceinline__ void load_biases(float (&v)[4], const float* p) {
#pragma unroll
    for (int j = 0; j < 4; j++) v[j] = p != nullptr ? __ldg(p + j) : 0.f;
}

// A finished gate or up value: its column's Hn(sum) / sqrt(128) * svh + bias (v: the Hadamard of the split sum).
__device__ __forceinline__ float finished(float v, float svh, float bias) { return v * INV_SQRT_128 * svh + bias; }

// The same, reading svh[j] and bias[j] (0 without biases) in the expression, where the packed epilogues read them.
__device__ __forceinline__ float finished(float v, const unsigned short* svh, const float* bias, int j) {
    return v * INV_SQRT_128 * half_to_float(svh[j]) + bias_at(bias, j);
}

// h_rot[j] = fp16(Hn(act(gate, up) * down's suh) / sqrt(128)) of a lane's 4 columns, from finished gate and up.
template <class Gate, class Up, class Suh>
__device__ __forceinline__ void store_activated(Gate&& gate, Up&& up, Suh&& down_suh, int activation, int has_limit,
                                                float limit, unsigned short* h_rot, int lane) {
    float h[4];
#pragma unroll
    for (int j = 0; j < 4; j++) h[j] = activate(gate(j), up(j), activation, has_limit, limit) * down_suh(j);
    hadamard128_warp(h, lane);
#pragma unroll
    for (int j = 0; j < 4; j++) h_rot[j] = float_to_half(h[j] * INV_SQRT_128);
}

// A direct route's gate/up arrival and epilogue (one row; pointers at the lane's column group), false for a block
// that is not the last: its vectors are read before the arrival, then gate (warp 0) and up (warp 1) are summed and
// finished at once, and warp 0 applies the activation and down's input rotation (not inlined: fewer registers for
// the mainloop).
__device__ __noinline__ bool finish_one_row(int* counter, int arrivals, const float* part, size_t up_offset,
                                            size_t split_stride, int splits, const unsigned short* gate_svh,
                                            const unsigned short* up_svh, const unsigned short* down_suh,
                                            const float* gate_bias, const float* up_bias, int activation,
                                            int has_limit, float limit, unsigned short* h_rot) {
    __shared__ float done[2][128];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float svh[4], shift[4], suh[4];
    if (warp < 2) {
        load_scales(svh, warp ? up_svh : gate_svh);
        load_biases(shift, warp ? up_bias : gate_bias);
        load_scales(suh, down_suh);
    }
    if (!last_arrival(counter, arrivals)) return false;
    if (warp < 2) {
        float v[4] = {0.f, 0.f, 0.f, 0.f};
        add_splits<SPLIT_BATCH, true>(v, part + warp * up_offset, split_stride, splits);
        hadamard128_warp(v, lane);
#pragma unroll
        for (int j = 0; j < 4; j++) done[warp][4 * lane + j] = finished(v[j], svh[j], shift[j]);
    }
    __syncthreads();
    if (warp == 0)
        store_activated([&](int j) { return done[0][4 * lane + j]; }, [&](int j) { return done[1][4 * lane + j]; },
                        [&](int j) { return suh[j]; }, activation, has_limit, limit, h_rot, lane);
    return true;
}

#if !WS || defined(WS_PRODUCE_GATE_UP)
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
                int ids_64) {
    TRACE_BEGIN;
    let_dependents_launch();
    const PrerequisiteOnExit chain{EARLY_GATE_UP && blockIdx.x + blockIdx.y + blockIdx.z == 0};
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
    const int split = split_index(), kt0 = split * ktiles_per_split, kt1 = min(kt0 + ktiles_per_split, hidden / 16);
    const size_t split_stride = (size_t)2 * capacity * inter;
#if !WS && !PRE_ROTATED && SUH_PREFETCH
    // The input scales of the block's k range, asked of L2 before the weights: every chunk's staging reads them.
    if (warp == 0) prefetch_l2_lines(suh + kt0 * 16, (kt1 - kt0) * 16 * 2, lane);
#endif
#if WS
    extern __shared__ __align__(16) unsigned char smem[];
    const WsShared sh(smem);
    ws_trace(0);
    const int tiles_n = inter / 16, jt = cblock * 8 + warp % WS_TILES;
    ws_mainloop(sh, x_rot + (size_t)proj * capacity * hidden, start, nrows, hidden, kt0, kt1,
                reinterpret_cast<const u32*>(trellis_addr[index]), k2[index] * 4 + codebook[index], index,
                3 * num_experts, num_stages, stage_addr, stage_k2, stage_codebook, stage_scale,
                [&](const u32* words, int key, u32 cursor) { WS_PRODUCE_GATE_UP(words, key, cursor) },
                [&](const WsAcc& acc, int row0) {
                    if (row0 < nrows)
                        store_partials(acc, part + split * split_stride + ((size_t)proj * capacity + start + row0) *
                                       inter, inter, nrows - row0, cblock * 8);
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
               3 * num_experts, num_stages, stage_addr, stage_k2, stage_codebook, stage_scale,
               [&](const u32* words, int key) { DISPATCH_GATE_UP(acc, words, key) });
#else
    DISPATCH_GATE_UP(acc, reinterpret_cast<const u32*>(trellis_addr[index]), k2[index] * 4 + codebook[index])
    add_stages(acc, index, 3 * num_experts, num_stages, stage_addr, stage_k2, stage_codebook, stage_scale,
               [&](const u32* words, int key) { STAGE_DISPATCH_GATE_UP(acc, words, key) });
#endif
    store_partials(acc, part + split * split_stride + ((size_t)proj * capacity + start) * inter, inter, nrows, jt0);
#endif
    TRACE_MARK(2);
#if !DIRECT_ROUTE   // a direct route's arrival is in finish_one_row, after its vectors are read
    if (!last_arrival(counters + b * (inter / 128) + cblock, 2 * splits)) {
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
    if (!finish_one_row(counters + b * (inter / 128) + cblock, 2 * splits, part + (size_t)start * inter + c,
                        (size_t)capacity * inter, split_stride, splits, gate_svh + c, up_svh + c, down_suh + c,
                        gate_bias ? gate_bias + c : nullptr, up_bias ? up_bias + c : nullptr, activation, has_limit,
                        limit, h_rot + (size_t)start * inter + c)) {
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
        add_splits<SPLIT_BATCH, true>(g, part + (size_t)(start + r) * inter + c, split_stride, splits);
        add_splits<SPLIT_BATCH, true>(u, part + ((size_t)capacity + start + r) * inter + c, split_stride, splits);
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

#if !WS
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
        if (split_index() == 0) combine_token(combine, b / combine.top_k, cblock, y, hidden, num_experts);
#else
        // Block 0 waits even without rows, so that down never completes before gate/up (the stream's next kernels
        // wait for down alone), even in a call whose every id lives elsewhere.
        if (blockIdx.x + blockIdx.y + blockIdx.z == 0) wait_for_prerequisite_grid();
#endif
        return;
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int index = 2 * num_experts + expert;
    const int split = split_index(), kt0 = split * ktiles_per_split, kt1 = min(kt0 + ktiles_per_split, inter / 16);
    const size_t split_stride = (size_t)capacity * hidden;
    const int jt0 = cblock * 8 + warp * NT, tiles_n = hidden / 16, mtiles = (nrows + 15) / 16;

    auto stage = [&](int c0) {   // h_rot rows: rotated input, once gate/up has written them
        if (c0 == kt0) wait_for_prerequisite_grid();
        copy_rows(xs, h_rot, start, nrows, inter, c0);
        if (c0 == kt0) TRACE_MARK(1);
    };
    float acc[MT][NT][2][4];
    zero_acc(acc);
    TRACE_MARK(0);
#if UNION_STAGES
    run_passes(acc, reinterpret_cast<const u32*>(trellis_addr[index]), k2[index] * 4 + codebook[index], index,
               3 * num_experts, num_stages, stage_addr, stage_k2, stage_codebook, stage_scale,
               [&](const u32* words, int key) { DISPATCH_DOWN(acc, words, key) });
#else
    DISPATCH_DOWN(acc, reinterpret_cast<const u32*>(trellis_addr[index]), k2[index] * 4 + codebook[index])
    add_stages(acc, index, 3 * num_experts, num_stages, stage_addr, stage_k2, stage_codebook, stage_scale,
               [&](const u32* words, int key) { STAGE_DISPATCH_DOWN(acc, words, key) });
#endif
    store_partials(acc, part + split * split_stride + (size_t)start * hidden, hidden, nrows, jt0);
    TRACE_MARK(2);
#if DIRECT_ROUTE
    // A direct route's one row: its vectors are read before the arrival, its token's combine inputs before the
    // combine's.
    const int c = cblock * 128 + 4 * lane, token = b / combine.top_k;
    float scale[4], shift[4];
    load_scales(scale, reinterpret_cast<const unsigned short*>(svh_addr[index]) + c);
    load_biases(shift, bias != nullptr ? bias + (size_t)expert * hidden + c : nullptr);
    if (!last_arrival(counters + b * (hidden / 128) + cblock, splits)) {
        TRACE_PRINT(2);
        return;
    }
    if (warp == 0) {
        float v[4] = {0.f, 0.f, 0.f, 0.f};
        add_splits<SPLIT_BATCH, true>(v, part + (size_t)start * hidden + c, split_stride, splits);
        hadamard128_warp(v, lane);
#pragma unroll
        for (int j = 0; j < 4; j++) y[(size_t)start * hidden + c + j] = v[j] * INV_SQRT_128 * scale[j] + shift[j];
    }
    TRACE_MARK(4);
    combine_token(combine, token, cblock, y, hidden, num_experts);
#else
    if (!last_arrival(counters + b * (hidden / 128) + cblock, splits)) {
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
        add_splits<SPLIT_BATCH, true>(v, part + (size_t)(start + r) * hidden + c, split_stride, splits);
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

#if WS && defined(WS_PRODUCE_GATE_UP)
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
                    continue;
                const int jt = (item % cblocks) * WS_TILES + warp % WS_TILES, index = (q & 1) * num_experts + expert;
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
            Consumer consumer(x_rot, sh.xs, sh.ring, 0, 0, hidden);
            WsAcc acc;
            for_each_item(items, cblocks, block_expert, block_start, offsets, num_experts,
                          [&](int expert, int start, int nrows, int item) {
                const int c0 = (item % cblocks) * 128 + 2 * t4;
#pragma unroll 1
                for (int proj = 0; proj < 2; proj++) {
                    const int index = proj * num_experts + expert;
                    consumer.retarget(x_rot + (size_t)proj * capacity * hidden, sh.xs, start, nrows, hidden);
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
            const float* __restrict__ bias, int num_experts, int hidden, int inter, int blocks) {
    extern __shared__ __align__(16) unsigned char smem[];
    const WsShared sh(smem);
    const int warp = threadIdx.x >> 5, cblocks = hidden / 128, items = blocks * cblocks;
    const int kt0 = 0, kt1 = inter / 16, tiles_n = hidden / 16, stride = 3 * num_experts;
    ws_roles(
        [&](u32& cursor) {
            for_each_item(items, cblocks, block_expert, block_start, offsets, num_experts,
                          [&](int expert, int start, int nrows, int item) {
                const int index = 2 * num_experts + expert, jt = (item % cblocks) * WS_TILES + warp % WS_TILES;
                ws_produce_index(trellis_addr, k2, codebook, index, stride, num_stages, stage_addr, stage_k2,
                                 stage_codebook, stage_scale, kt1 / STAGE_KT, cursor,
                                 [&](const u32* words, int key, u32 at) { WS_PRODUCE_DOWN(words, key, at) });
            });
        },
        [&] {
            const int lane = threadIdx.x & 31, row0 = consumer_row0() + (lane >> 2), t4 = lane & 3;
            Consumer consumer(h_rot, sh.xs, sh.ring, 0, 0, inter);
            WsAcc acc;
            // The first item with rows from `item` on (items if none), its first x chunk staged.
            auto stage_next = [&](int item, int& expert, int& start, int& nrows) {
                for (; item < items; item += gridDim.x)
                    if (route_block(item / cblocks, block_expert, block_start, offsets, 0, num_experts, expert,
                                    start, nrows)) {
                        consumer.retarget(h_rot, sh.xs, start, nrows, inter);
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
                hadamard_rows(acc);
                const unsigned short* svh = reinterpret_cast<const unsigned short*>(svh_addr[index]);
                const float* down_bias = bias != nullptr ? bias + (size_t)expert * hidden : nullptr;
#pragma unroll
                for (int half = 0; half < 2; half++) {
                    const int r = row0 + 8 * half;
                    if (r >= nrows) continue;
                    float* dst = y + (size_t)sorted_slots[start + r] * hidden;
#pragma unroll
                    for (int nt = 0; nt < 8; nt++)
#pragma unroll
                        for (int h = 0; h < 2; h++) {
                            const int c = c0 + nt * 16 + h * 8;
                            float o[2];
#pragma unroll
                            for (int j = 0; j < 2; j++)
                                o[j] = acc[0][nt][h][2 * half + j] * INV_SQRT_128 * half_to_float(svh[c + j]) +
                                       bias_at(down_bias, c + j);
                            *reinterpret_cast<float2*>(dst + c) = make_float2(o[0], o[1]);
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
