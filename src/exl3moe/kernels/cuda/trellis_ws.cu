// EXL3 linear for blocks of 128 rows, warp-specialized: producer warps decode the 8 n16 tiles of a 128-column block
// into a ring of shared-memory stages (each lane's mma.sync B fragments, as trellis_mma decodes them), and consumer
// warps (32 rows x 16 CONSUMER_TILES columns each) run mma.sync on them with x staged by cp.async. Every output element
// gets the same k16 products in the same order as trellis_mma at 8 m16 tiles, and the same split partials, so the
// two kernels give the same bytes. A block runs `splits_per_block` consecutive splits. Compile-time (-D): K2, CB,
// PF (k-tiles of words prefetched per producer), STAGES (ring depth in k-tiles), PAIR_SCALAR.
#include "trellis_core.cuh"

constexpr int WS_ROWS = 128, WS_TILES = 8;
constexpr int PRODUCERS = 16, K_TURNS = PRODUCERS / WS_TILES;   // the producers of a column take k-tiles in turn
constexpr int CONSUMER_TILES = 2, CONSUMERS = 4 * (WS_TILES / CONSUMER_TILES);
constexpr int WS_THREADS = (PRODUCERS + CONSUMERS) * 32;
static_assert((CHUNK / K_TURNS) % PF == 0, "a producer's k-tiles of a chunk must be whole prefetch rounds");
constexpr int STAGE_U32 = WS_TILES * 32 * 4;          // one k-tile of the block: 8 tiles x 32 lanes x 4 fragments
constexpr int XS_HALVES = WS_ROWS * XS;                // one staged x chunk (128 rows x 128 inputs, row stride XS)
constexpr int TOTAL_FLOATS = WS_ROWS * 128;            // a block running every split: the running fp32 sum

__device__ __forceinline__ u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void mbar_init(u64* bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}

// One arrival for the calling warp, after all its lanes' earlier shared-memory accesses.
__device__ __forceinline__ void warp_arrive(u64* bar) {
    __syncwarp();
    if ((threadIdx.x & 31) == 0)
        asm volatile("{ .reg .b64 state; mbarrier.arrive.shared::cta.b64 state, [%0]; }" ::"r"(smem_addr(bar))
                     : "memory");
}

// Returns once the phase of parity `parity` of *bar has completed.
__device__ __forceinline__ void mbar_wait(u64* bar, u32 parity) {
    u32 done;
    do {
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                     : "=r"(done) : "r"(smem_addr(bar)), "r"(parity) : "memory");
    } while (!done);
}

// 16 bytes from src to shared dst, or zeros when !valid (src is then not read).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_addr(dst)), "l"(src), "r"(valid ? 16 : 0)
                 : "memory");
}

__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, %0;" ::"n"(CONSUMERS * 32) : "memory"); }

// Producer warp p: tile column jt (the block's p % 8th), k-tiles kt_begin + i for i = p / 8 (mod K_TURNS), each
// decoded into ring stage i % STAGES.
__device__ __forceinline__ void produce(u32* ring, u64* full, u64* empty, const u32* __restrict__ words, int tiles_n,
                                       int jt, int kt_begin, int kt_end, int p) {
    using T = Trellis<K2, CB>;
    const int lane = threadIdx.x & 31;
    const int first_bit = T::first_bit(lane);
    const u32 sh = first_bit & 31;
    const int turn = p / WS_TILES, mine = (kt_end - kt_begin) / K_TURNS;   // k ranges are whole chunks
    const size_t k_stride = (size_t)tiles_n * T::WT * K_TURNS;
    const u32* ptr[T::NW];
#pragma unroll
    for (int i = 0; i < T::NW; i++)
        ptr[i] = words + (size_t)jt * T::WT + ((first_bit >> 5) + i) % T::WT + (size_t)(kt_begin + turn) * tiles_n * T::WT;
    u32 buf[PF][T::NW];
#pragma unroll
    for (int q = 0; q < PF; q++) {
#pragma unroll
        for (int i = 0; i < T::NW; i++) buf[q][i] = __ldg(ptr[i]);
        if (q + 1 < mine) {
#pragma unroll
            for (int i = 0; i < T::NW; i++) ptr[i] += k_stride;
        }
    }
    for (int j0 = 0; j0 < mine; j0 += PF) {
#pragma unroll
        for (int q = 0; q < PF; q++) {
            const int j = j0 + q, i = j * K_TURNS + turn, s = i % STAGES;
            u32 b[4];
            T::decode_tile(buf[q], sh, b);
#pragma unroll
            for (int w = 0; w < T::NW; w++) buf[q][w] = __ldg(ptr[w]);
            if (j + PF + 1 < mine) {
#pragma unroll
                for (int w = 0; w < T::NW; w++) ptr[w] += k_stride;
            }
            mbar_wait(empty + s, ((i / STAGES) & 1) ^ 1);
            *reinterpret_cast<uint4*>(ring + s * STAGE_U32 + (p % WS_TILES) * 128 + lane * 4) =
                make_uint4(b[0], b[1], b[2], b[3]);
            warp_arrive(full + s);
        }
    }
}

// Consumer threads stage x rows [m0, m0 + 128) of chunk c0 (128 inputs) into xs; rows past block_rows read as 0.
__device__ __forceinline__ void stage_x(unsigned short* xs, const unsigned short* __restrict__ x, int m0,
                                       int block_rows, int stride_x, int c0, int ct) {
    for (int v = ct; v < WS_ROWS * 16; v += CONSUMERS * 32) {
        const int r = v >> 4, c = (v & 15) * 8;
        const bool valid = r < block_rows;
        cp_async16(xs + r * XS + c, x + (size_t)(m0 + (valid ? r : 0)) * stride_x + c0 * 16 + c, valid);
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
}

extern "C" __global__ void __launch_bounds__(WS_THREADS, 1)
trellis_ws(const unsigned short* __restrict__ x, const u32* __restrict__ words, float* __restrict__ part,
           const unsigned short* __restrict__ svh, const unsigned short* __restrict__ bias, void* __restrict__ out,
           int out_dtype, int* __restrict__ counters, int rows, int n, int tiles_n, int ktiles_total,
           int ktiles_per_split, int stride_x, int stride_out, int splits, int splits_per_block) {
    extern __shared__ __align__(16) unsigned char smem[];
    u32* ring = reinterpret_cast<u32*>(smem);
    unsigned short* xs = reinterpret_cast<unsigned short*>(smem + STAGES * STAGE_U32 * 4);
    float* total = reinterpret_cast<float*>(smem + STAGES * STAGE_U32 * 4 + 2 * XS_HALVES * 2);
    u64* full = reinterpret_cast<u64*>(total + TOTAL_FLOATS);
    u64* empty = full + STAGES;
    // One block per (128 columns, 128 rows) sums the splits itself, in split order as reduce_group does.
    const bool whole = splits_per_block >= splits;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int m0 = blockIdx.z * WS_ROWS, block_rows = min(WS_ROWS, rows - m0);
    const int split0 = blockIdx.y * splits_per_block, split1 = min(split0 + splits_per_block, splits);
    const int kt_begin = split0 * ktiles_per_split, kt_end = min(split1 * ktiles_per_split, ktiles_total);
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; s++) {
            mbar_init(full + s, WS_TILES);
            mbar_init(empty + s, CONSUMERS);
        }
    }
    __syncthreads();

    if (warp < PRODUCERS) {
        produce(ring, full, empty, words, tiles_n, blockIdx.x * WS_TILES + warp % WS_TILES, kt_begin, kt_end, warp);
    } else {
        const int c = warp - PRODUCERS, mg = c & 3, ng = c >> 2, ct = threadIdx.x - PRODUCERS * 32;
        const int my_rows = block_rows - 32 * mg, mtiles = min(2, max(0, (my_rows + 15) / 16));
        const int jt0 = blockIdx.x * WS_TILES + CONSUMER_TILES * ng;
        const u32 a_lane = smem_addr(xs + (32 * mg + (lane & 15)) * XS + (lane >> 4) * 8);
        float acc[2][CONSUMER_TILES][2][4];
        zero_acc(acc);
        stage_x(xs, x, m0, block_rows, stride_x, kt_begin, ct);
        int i = 0;
        for (int split = split0; split < split1; split++) {
            const int kt0 = split * ktiles_per_split, kt1 = min(kt0 + ktiles_per_split, ktiles_total);
            for (int c0 = kt0; c0 < kt1; c0 += CHUNK) {
                const int buf = ((c0 - kt_begin) / CHUNK) & 1;
                consumers_sync();  // every consumer is done with the other buffer's chunk
                if (c0 + CHUNK < kt_end) stage_x(xs + (buf ^ 1) * XS_HALVES, x, m0, block_rows, stride_x, c0 + CHUNK, ct);
                else asm volatile("cp.async.commit_group;" ::: "memory");
                asm volatile("cp.async.wait_group 1;" ::: "memory");
                consumers_sync();  // this chunk's rows are in xs[buf]
#pragma unroll 2
                for (int s = 0; s < CHUNK; s++, i++) {
                    const int st = i % STAGES;
                    mbar_wait(full + st, (i / STAGES) & 1);
                    u32 b[CONSUMER_TILES][4];
#pragma unroll
                    for (int t = 0; t < CONSUMER_TILES; t++) {
                        const uint4 q = *reinterpret_cast<const uint4*>(ring + st * STAGE_U32 +
                                                                        (CONSUMER_TILES * ng + t) * 128 + lane * 4);
                        b[t][0] = q.x; b[t][1] = q.y; b[t][2] = q.z; b[t][3] = q.w;
                    }
#pragma unroll
                    for (int mt = 0; mt < 2; mt++) {
                        if (mt < mtiles) {
                            u32 a[4];
                            ldmatrix_x4(a, a_lane + (buf * XS_HALVES + mt * 16 * XS + s * 16) * 2);
#pragma unroll
                            for (int t = 0; t < CONSUMER_TILES; t++) {
                                mma16816(acc[mt][t][0], a, b[t][0], b[t][1]);
                                mma16816(acc[mt][t][1], a, b[t][2], b[t][3]);
                            }
                        }
                    }
                    warp_arrive(empty + st);
                }
            }
            if (whole) {
                // total = ((0 + p0) + p1) + ...: each thread adds its own elements, where store_partials puts them.
                const int g = lane >> 2, t4 = lane & 3;
#pragma unroll
                for (int mt = 0; mt < 2; mt++)
#pragma unroll
                    for (int nt = 0; nt < CONSUMER_TILES; nt++)
#pragma unroll
                        for (int h = 0; h < 2; h++)
#pragma unroll
                            for (int e = 0; e < 4; e++) {
                                const int r = 32 * mg + mt * 16 + g + 8 * (e >> 1);
                                const int col = (CONSUMER_TILES * ng + nt) * 16 + h * 8 + 2 * t4 + (e & 1);
                                float& t = total[r * 128 + col];
                                t = (split == split0 ? 0.f : t) + acc[mt][nt][h][e];
                            }
            } else if (my_rows > 0) {
                store_partials(acc, part + ((size_t)split * rows + m0 + 32 * mg) * n, n, my_rows, jt0);
            }
            zero_acc(acc);
        }
    }
    constexpr int WARPS_ALL = PRODUCERS + CONSUMERS;
    if (whole) {
        __syncthreads();
        auto sum = [&](float (&v)[4], int r) {
            const float4 q = *reinterpret_cast<const float4*>(total + r * 128 + 4 * lane);
            v[0] += q.x; v[1] += q.y; v[2] += q.z; v[3] += q.w;
        };
        finish_group<WS_ROWS / WARPS_ALL>(sum, svh, bias, out, out_dtype, m0, block_rows, blockIdx.x * 128,
                                          stride_out, WARPS_ALL);
        return;
    }
    if (!last_arrival(counters + blockIdx.z * (n / 128) + blockIdx.x, gridDim.y)) return;
    reduce_group<WS_ROWS / WARPS_ALL>(part, svh, bias, out, out_dtype, rows, n, m0, block_rows, blockIdx.x * 128,
                                      stride_out, splits, WARPS_ALL);
}
