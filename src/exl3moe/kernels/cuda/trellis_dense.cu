// W_inner [k, n] fp16 (row-major) decoded from the trellis [k / 16, n / 16, 16 K] words, for the GEMM of large
// calls. One warp per (n16 tile, DENSE_KTILES k-tiles), all their words loaded first: each lane decodes its 8
// positions (its mma B fragments), the warp transposes the tile through shared memory and writes 16 rows of 32
// bytes. Compile-time (-D): K2, CB, DENSE_KTILES.
#include "trellis_core.cuh"

extern "C" __global__ void __launch_bounds__(128)
trellis_dense(const u32* __restrict__ words, unsigned short* __restrict__ dense, int tiles_n, int ktiles) {
    using T = Trellis<K2, CB>;
    __shared__ __align__(16) unsigned short tile[4][16 * 16];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int jt = blockIdx.x * 4 + warp;
    const int kt0 = blockIdx.y * DENSE_KTILES, kt1 = min(kt0 + DENSE_KTILES, ktiles);
    if (jt >= tiles_n) return;
    const int first_bit = T::first_bit(lane);
    const u32 sh = first_bit & 31;
    const size_t k_stride = (size_t)tiles_n * T::WT, n = (size_t)tiles_n * 16;
    const u32* base = words + (size_t)jt * T::WT;
    int offset[T::NW];
#pragma unroll
    for (int i = 0; i < T::NW; i++) offset[i] = ((first_bit >> 5) + i) % T::WT;
    u32 w[DENSE_KTILES][T::NW];
#pragma unroll
    for (int j = 0; j < DENSE_KTILES; j++)
#pragma unroll
        for (int i = 0; i < T::NW; i++) w[j][i] = kt0 + j < kt1 ? __ldg(base + (kt0 + j) * k_stride + offset[i]) : 0u;
    unsigned short* mine = tile[warp];
#pragma unroll
    for (int j = 0; j < DENSE_KTILES; j++) {
        const int kt = kt0 + j;
        if (kt >= kt1) break;
        u32 b[4];
        T::decode_tile(w[j], sh, b);
        // b[0] = rows 2t, 2t + 1 of column g; b[1] rows 2t + 8, 2t + 9; b[2], b[3] the same of column g + 8.
#pragma unroll
        for (int f = 0; f < 4; f++) {
            const int row = 2 * t + 8 * (f & 1), col = g + 8 * (f >> 1);
            mine[row * 16 + col] = (unsigned short)(b[f] & 0xffffu);
            mine[(row + 1) * 16 + col] = (unsigned short)(b[f] >> 16);
        }
        __syncwarp();
        const int row = lane >> 1, half = lane & 1;
        *reinterpret_cast<uint4*>(dense + ((size_t)kt * 16 + row) * n + jt * 16 + half * 8) =
            *reinterpret_cast<const uint4*>(mine + row * 16 + half * 8);
        __syncwarp();
    }
}

// out[r, c] = Hn128(y[r, 128-column chunk of c]) * svh[c] + bias[c], y fp32 [rows, n] (the GEMM's output): one warp
// per (row, 128 columns), grid (rows, n / 512); the arithmetic of trellis_mma's reduction for one split.
extern "C" __global__ void __launch_bounds__(128)
dense_epilogue(const float* __restrict__ y, const unsigned short* __restrict__ svh,
               const unsigned short* __restrict__ bias, void* __restrict__ out, int out_dtype, int n, int stride_out) {
    const int lane = threadIdx.x & 31, chunk = blockIdx.y * 4 + (threadIdx.x >> 5);
    if (chunk * 128 >= n) return;
    const int c = chunk * 128 + 4 * lane;
    const size_t r = blockIdx.x;
    const float4 q = __ldg(reinterpret_cast<const float4*>(y + r * n + c));
    float v[4] = {q.x, q.y, q.z, q.w};
    hadamard128_warp(v, lane);
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const float bias_j = bias != nullptr ? half_to_float(bias[c + j]) : 0.f;
        const float o = v[j] * INV_SQRT_128 * half_to_float(svh[c + j]) + bias_j;
        if (out_dtype == 2) reinterpret_cast<float*>(out)[r * stride_out + c + j] = o;
        else if (out_dtype == 1) reinterpret_cast<unsigned short*>(out)[r * stride_out + c + j] = float_to_bf16(o);
        else reinterpret_cast<unsigned short*>(out)[r * stride_out + c + j] = float_to_half(o);
    }
}
