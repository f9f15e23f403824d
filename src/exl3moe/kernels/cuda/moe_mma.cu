// Routed EXL3 experts on mma.sync, for route blocks of up to 16 rows (one m16 tile), driven by the MoE tables.
// Compile-time (-D): PF prefetched k-tiles; the prelude defines DISPATCH_GATE_UP / DISPATCH_DOWN, switches over
// the (2K, codebook) variants present in the layer, each calling mma_mainloop for one variant.
// gate/up: grid (route block, 2 x I / 128, splits); block (b, 2 c + p) computes projection p (0 gate, 1 up) for
// I columns [128 c, 128 c + 128) over its hidden split; the last of the 2 x splits arrivals applies both output
// Hadamards and svh, the activation, down's suh and input Hadamard, and stores h_rot[pos] fp16.
// down: grid (route block, H / 128, splits); the last arrival writes y[slot] = Hn(sum) * svh, fp32.
#include "trellis_core.cuh"

constexpr int WARPS = 4;

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

// Expert, first sorted position and row count (<= 16) of route block b; false for an unused block.
__device__ __forceinline__ bool route_block(int b, const int* block_expert, const int* block_start, const int* offsets,
                                            int& expert, int& start, int& nrows) {
    expert = block_expert[b];
    if (expert < 0) return false;
    start = block_start[b];
    nrows = min(16, offsets[expert + 1] - start);
    return true;
}

extern "C" __global__ void __launch_bounds__(WARPS * 32)
moe_gate_up_mma(const unsigned short* __restrict__ x, int x_bf16, int stride_x, const int* __restrict__ block_expert,
                const int* __restrict__ block_start, const int* __restrict__ offsets,
                const int* __restrict__ sorted_slots, int top_k, const long long* __restrict__ trellis_addr,
                const long long* __restrict__ suh_addr, const long long* __restrict__ svh_addr,
                const int* __restrict__ variant, int num_experts, int hidden, int inter, float* __restrict__ part,
                int capacity, unsigned short* __restrict__ h_rot, int* __restrict__ counters, int ktiles_per_split,
                int splits, int activation, int has_limit, float limit) {
    __shared__ __align__(16) unsigned short xs[16 * XS];
    const int b = blockIdx.x;
    int expert, start, nrows;
    if (!route_block(b, block_expert, block_start, offsets, expert, start, nrows)) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int proj = blockIdx.y & 1, cblock = blockIdx.y >> 1;
    const int index = proj * num_experts + expert;
    const u32* words = reinterpret_cast<const u32*>(trellis_addr[index]);
    const unsigned short* suh = reinterpret_cast<const unsigned short*>(suh_addr[index]);
    const int split = blockIdx.z, kt0 = split * ktiles_per_split, kt1 = min(kt0 + ktiles_per_split, hidden / 16);
    const int jt0 = cblock * 8 + warp * 2, tiles_n = inter / 16;

    auto stage = [&](int c0) {
        // xs = fp16(Hn128(x[token] * suh)) of this chunk; rows past the block's are zeroed once.
        if (c0 == kt0) {
            for (int v = threadIdx.x; v < (16 - nrows) * 128; v += WARPS * 32) xs[(nrows + v / 128) * XS + v % 128] = 0;
        }
        for (int r = warp; r < nrows; r += WARPS) {
            const int token = sorted_slots[start + r] / top_k;
            const int c = c0 * 16 + 4 * lane;
            const unsigned short* xr = x + (size_t)token * stride_x + c;
            float v[4];
#pragma unroll
            for (int j = 0; j < 4; j++) v[j] = input_to_float(xr[j], x_bf16) * half_to_float(suh[c + j]);
            hadamard128_warp(v, lane);
#pragma unroll
            for (int j = 0; j < 4; j++) xs[r * XS + 4 * lane + j] = float_to_half(v[j] * INV_SQRT_128);
        }
    };
    float acc[1][2][2][4];
    zero_acc(acc);
    DISPATCH_GATE_UP
    const size_t split_stride = (size_t)2 * capacity * inter;
    store_partials(acc, part + split * split_stride + ((size_t)proj * capacity + start) * inter, inter, nrows, jt0);
    if (!last_arrival(counters + b * (inter / 128) + cblock, 2 * splits)) return;

    const int c = cblock * 128 + 4 * lane;
    const unsigned short* gate_svh = reinterpret_cast<const unsigned short*>(svh_addr[expert]);
    const unsigned short* up_svh = reinterpret_cast<const unsigned short*>(svh_addr[num_experts + expert]);
    const unsigned short* down_suh = reinterpret_cast<const unsigned short*>(suh_addr[2 * num_experts + expert]);
    for (int r = warp; r < nrows; r += WARPS) {
        float g[4] = {0.f, 0.f, 0.f, 0.f}, u[4] = {0.f, 0.f, 0.f, 0.f}, h[4];
        add_splits(g, part + (size_t)(start + r) * inter + c, split_stride, splits);
        add_splits(u, part + ((size_t)capacity + start + r) * inter + c, split_stride, splits);
        hadamard128_warp(g, lane);
        hadamard128_warp(u, lane);
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const float gv = g[j] * INV_SQRT_128 * half_to_float(gate_svh[c + j]);
            const float uv = u[j] * INV_SQRT_128 * half_to_float(up_svh[c + j]);
            h[j] = activate(gv, uv, activation, has_limit, limit) * half_to_float(down_suh[c + j]);
        }
        hadamard128_warp(h, lane);
#pragma unroll
        for (int j = 0; j < 4; j++) h_rot[(size_t)(start + r) * inter + c + j] = float_to_half(h[j] * INV_SQRT_128);
    }
}

extern "C" __global__ void __launch_bounds__(WARPS * 32)
moe_down_mma(const unsigned short* __restrict__ h_rot, float* __restrict__ y, const int* __restrict__ block_expert,
             const int* __restrict__ block_start, const int* __restrict__ offsets,
             const int* __restrict__ sorted_slots, const long long* __restrict__ trellis_addr,
             const long long* __restrict__ svh_addr, const int* __restrict__ variant, int num_experts, int hidden,
             int inter, float* __restrict__ part, int capacity, int* __restrict__ counters, int ktiles_per_split,
             int splits) {
    __shared__ __align__(16) unsigned short xs[16 * XS];
    const int b = blockIdx.x;
    int expert, start, nrows;
    if (!route_block(b, block_expert, block_start, offsets, expert, start, nrows)) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int cblock = blockIdx.y;
    const int index = 2 * num_experts + expert;
    const u32* words = reinterpret_cast<const u32*>(trellis_addr[index]);
    const int split = blockIdx.z, kt0 = split * ktiles_per_split, kt1 = min(kt0 + ktiles_per_split, inter / 16);
    const int jt0 = cblock * 8 + warp * 2, tiles_n = hidden / 16;

    auto stage = [&](int c0) {
        // h_rot rows are down's rotated input already: copy the chunk, zero rows past the block's.
        for (int v = threadIdx.x; v < 16 * 16; v += WARPS * 32) {
            const int r = v >> 4, cc = (v & 15) * 8;
            uint4 val = make_uint4(0, 0, 0, 0);
            if (r < nrows) val = *reinterpret_cast<const uint4*>(h_rot + (size_t)(start + r) * inter + c0 * 16 + cc);
            *reinterpret_cast<uint4*>(xs + r * XS + cc) = val;
        }
    };
    float acc[1][2][2][4];
    zero_acc(acc);
    DISPATCH_DOWN
    const size_t split_stride = (size_t)capacity * hidden;
    store_partials(acc, part + split * split_stride + (size_t)start * hidden, hidden, nrows, jt0);
    if (!last_arrival(counters + b * (hidden / 128) + cblock, splits)) return;

    const int c = cblock * 128 + 4 * lane;
    const unsigned short* svh = reinterpret_cast<const unsigned short*>(svh_addr[index]);
    for (int r = warp; r < nrows; r += WARPS) {
        float v[4] = {0.f, 0.f, 0.f, 0.f};
        add_splits(v, part + (size_t)(start + r) * hidden + c, split_stride, splits);
        hadamard128_warp(v, lane);
        const size_t slot = sorted_slots[start + r];
#pragma unroll
        for (int j = 0; j < 4; j++) y[slot * hidden + c + j] = v[j] * INV_SQRT_128 * half_to_float(svh[c + j]);
    }
}
