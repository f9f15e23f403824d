// moe_mma.cu's route blocks and grids, the direct route's combine, early launches, residual-stage passes, and
// x staging (copies of pre-rotated rows, or rotation of a chunk).
#pragma once
constexpr int BLOCK_M = 16 * MT;
#ifndef ROUTE_ROWS
#define ROUTE_ROWS (16 * MT)   // a route block's rows where they exceed the module's m16 tiles (192-row blocks)
#endif
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
#ifndef STAGE_BLOCKS
#define STAGE_BLOCKS 0   // 1: the stages' passes in blocks of their own, after every base block along the grid's z
#endif
static_assert(!(WS && STAGE_BLOCKS), "a warp-specialized block runs its stages' passes itself");
// Whether the block runs the stages' passes: the second half of z (z is route blocks with SPLIT_INNER, else splits).
__device__ __forceinline__ bool stage_pass() { return STAGE_BLOCKS && blockIdx.z >= gridDim.z / 2; }
__device__ __forceinline__ int base_z() { return blockIdx.z - (stage_pass() ? gridDim.z / 2 : 0); }
__device__ __forceinline__ int route_block_index() {
    return SPLIT_INNER ? base_z() : ROUTE_MAJOR ? blockIdx.y : blockIdx.x;
}
__device__ __forceinline__ int column_block_index() { return ROUTE_MAJOR ? blockIdx.x : blockIdx.y; }
__device__ __forceinline__ int split_index() { return SPLIT_INNER ? blockIdx.y : base_z(); }

// Whether any stage has a nonzero scale at index (its projection's residual work runs).
__device__ __forceinline__ bool stage_active(int index, int stride, int num_stages, const float* __restrict__ scale) {
    for (int s = 0; s < num_stages; s++)
        if (scale[s * stride + index] != 0.f) return true;
    return false;
}

// A block's k split and pass: with STAGE_BLOCKS the stage passes run after the base's blocks (where no stage is
// active they exit at once, in the base's tail) and store their partials after the base's, so the last arrival sums
// base then stages in order.
struct SplitPass {
    int split, partial;   // k split, and the partial slot it stores
    bool stages;          // runs the stages' passes (else the base)
};
__device__ __forceinline__ SplitPass split_pass(int splits) {
    const int split = split_index();
    return stage_pass() ? SplitPass{split, splits + split, true} : SplitPass{split, split, false};
}

// Partials the last arrival sums for projection index: the base's splits, and as many again where a stage is active.
__device__ __forceinline__ int summed_splits(int splits, int index, int stride, int num_stages,
                                             const float* __restrict__ scale) {
    return STAGE_BLOCKS && stage_active(index, stride, num_stages, scale) ? 2 * splits : splits;
}

// Expert, first sorted position and row count (<= ROUTE_ROWS) of route block b; false for an unused block.
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
    nrows = min(ROUTE_ROWS, offsets[expert + 1] - start);
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
#ifndef CHAIN_ON_EXIT
#define CHAIN_ON_EXIT 0   // 1 (with EARLY_LAUNCH): the 192-row kernel of split route blocks, after the 128-row one
#endif
// An early gate/up (or split route blocks' 192-row kernel) reads nothing its prerequisite writes, but must not
// complete before it: the kernels after it wait for it alone. Block 0 waits for the prerequisite when it leaves,
// wherever it returns.
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
        ys[j] = j < cb.top_k && (in.local >> j & 1u) ? __ldcg(y + ((size_t)token * cb.top_k + j) * hidden + c) : 0.f;
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

#ifndef SCALE_AHEAD
#define SCALE_AHEAD 0   // 1 (stage plans): the first stage's scale is read at the block's start (first_stage_scale)
#endif
// scale[index], the first stage's scale, read before the base's mainloop so that no block waits for it after.
__device__ __forceinline__ float first_stage_scale(int num_stages, int index, const float* __restrict__ scale) {
    return SCALE_AHEAD && num_stages > 0 ? __ldg(scale + index) : 0.f;
}

#ifndef STAGE_WORDS_AHEAD
#define STAGE_WORDS_AHEAD 0   // 1 (direct stage plans): a block's first-stage words asked of L2 before its mainloop
#endif
// The first stage's scale, trellis words and lines per k-tile row (8 tiles of 32 K bytes: k2 = 2 K lines of 128
// bytes) at `index`, read at a block's start by its last warp alone (the others get none).
struct StageWords {
    const char* words;
    int lines;
    float scale;
};
__device__ __forceinline__ StageWords first_stage_words(int num_stages, int index, const long long* __restrict__ addr,
                                                        const int* __restrict__ k2, const float* __restrict__ scale,
                                                        int warp) {
    if (!STAGE_WORDS_AHEAD || num_stages == 0 || warp != WARPS - 1) return {nullptr, 0, 0.f};
    return {reinterpret_cast<const char*>(__ldg(addr + index)), __ldg(k2 + index), __ldg(scale + index)};
}

// L2 asked for the first stage's words of k-tiles [kt0, kt1) x tile columns [jt0, jt0 + 8) when its scale is
// nonzero, so that the stage's mainloop after the base's finds them there.
__device__ __forceinline__ void prefetch_stage_words(StageWords w, int tiles_n, int kt0, int kt1, int jt0, int lane) {
    if (w.words == nullptr || w.scale == 0.f) return;
    for (int i = lane; i < (kt1 - kt0) * w.lines; i += 32) {
        const size_t tile = (size_t)(kt0 + i / w.lines) * tiles_n + jt0;
        asm volatile("prefetch.global.L2 [%0];" ::"l"(w.words + tile * 16 * w.lines + 128 * (i % w.lines)));
    }
}

// acc += scale x (xs @ R) for each stage with a nonzero scale at index + s x stride, computed as
// scale x (acc / scale + xs @ R) so no second accumulator is live; run(words, key) runs one mainloop. scale0: the
// first stage's scale (first_stage_scale).
template <class Acc, class Run>
__device__ __forceinline__ void add_stages(Acc& acc, int index, int stride, int num_stages,
                                           const long long* __restrict__ addr, const int* __restrict__ k2,
                                           const int* __restrict__ codebook, const float* __restrict__ scale,
                                           float scale0, Run&& run) {
    for (int s = 0; s < num_stages; s++) {
        const int i = s * stride + index;
        const float f = SCALE_AHEAD && s == 0 ? scale0 : scale[i];
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
// Passes from `first` (-1 the base, 0 the first stage) up to num_stages.
template <class Acc, class Run>
__device__ __forceinline__ void run_passes(Acc& acc, const u32* base_words, int base_key, int index, int stride,
                                           int num_stages, const long long* __restrict__ addr,
                                           const int* __restrict__ k2, const int* __restrict__ codebook,
                                           const float* __restrict__ scale, float scale0, Run&& run,
                                           int first = -1) {
    for (int s = first; s < num_stages; s++) {
        const u32* words = base_words;
        int key = base_key;
        float f = 1.f;
        if (s >= 0) {
            const int i = s * stride + index;
            f = SCALE_AHEAD && s == 0 ? scale0 : scale[i];
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
