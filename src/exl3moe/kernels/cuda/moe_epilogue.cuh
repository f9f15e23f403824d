// moe_mma.cu's epilogue helpers: vectors read ahead, finished gate / up values, the activation with down's input
// rotation, and the direct route's one-row finish.
#pragma once
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
// that is not the last: its vectors are read before the arrival, then gate (warp 0, gate_splits partials) and up
// (warp 1, up_splits) are summed and finished at once, and warp 0 applies the activation and down's input rotation
// (not inlined: fewer registers for the mainloop).
__device__ __noinline__ bool finish_one_row(int* counter, int gate_splits, int up_splits, const float* part,
                                            size_t up_offset, size_t split_stride, const unsigned short* gate_svh,
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
    if (!last_arrival(counter, gate_splits + up_splits)) return false;
    if (warp < 2) {
        float v[4] = {0.f, 0.f, 0.f, 0.f};
        add_splits<SPLIT_BATCH, true>(v, part + warp * up_offset, split_stride, warp ? up_splits : gate_splits);
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
