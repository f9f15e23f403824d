// EXL3 linear for blocks of 128 rows on sm_90a, warp-specialized: producer warps decode the 8 n16 tiles of a
// 128-column block into a ring of shared-memory stages (the mma.sync B fragments trellis_mma decodes, stored as
// wgmma core matrices), and four consumer warpgroups (64 rows x 64 columns each) run one wgmma m64n64k16 per k-tile
// on them, with x staged by cp.async in the 128-byte swizzle. A k16 step sums to the same bits on wgmma as on
// mma.sync, and every output element gets the same products in the same order and the same split partials as
// trellis_mma, so the two kernels give the same bytes. A block runs `splits_per_block` consecutive splits.
// Compile-time (-D): K2, CB, PF (k-tiles of words prefetched per producer), STAGES (ring stages of STAGE_KT
// k-tiles), PAIR_SCALAR.
#include "trellis_core.cuh"

constexpr int WS_ROWS = 128, WS_TILES = 8;
constexpr int PRODUCERS = 16, K_TURNS = PRODUCERS / WS_TILES;   // the producers of a column take k-tiles in turn
constexpr int CONSUMERS = 16;                           // four warpgroups
constexpr int WS_THREADS = (PRODUCERS + CONSUMERS) * 32;
#ifndef STAGE_KT
#define STAGE_KT 4                                      // k-tiles per ring stage
#endif
constexpr int PF_STAGES = PF / STAGE_KT;               // stages of words prefetched
static_assert((CHUNK / (STAGE_KT * K_TURNS)) % PF_STAGES == 0, "a producer's stages of a chunk: whole prefetch rounds");
constexpr int KTILE_U32 = WS_TILES * 32 * 4;          // one k-tile of the block: 8 tiles x 32 lanes x 4 fragments
constexpr int STAGE_U32 = STAGE_KT * KTILE_U32;
constexpr u32 XS_BYTES = 32 * 1024;                    // one staged x chunk (128 rows x 128 inputs), 1024-aligned
constexpr int TOTAL_STRIDE = 136;                     // row stride of the running sum: conflict-free float2 access
constexpr int TOTAL_FLOATS = WS_ROWS * TOTAL_STRIDE;   // a block running every split: the running fp32 sum

__device__ __forceinline__ u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void mbar_init(u64* bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}


// Returns once the phase of parity `parity` of *bar has completed.
__device__ __forceinline__ void mbar_wait(u64* bar, u32 parity) {
    u32 done;
    do {  // the time hint lets the warp sleep until the phase completes instead of polling
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2, 0x989680; "
                     "selp.u32 %0, 1, 0, p; }" : "=r"(done) : "r"(smem_addr(bar)), "r"(parity) : "memory");
    } while (!done);
}

// One arrival for the calling warp, from lane 0 (after a wgmma wait that covers every lane's reads).
__device__ __forceinline__ void lane0_arrive(u64* bar) {
    if ((threadIdx.x & 31) == 0)
        asm volatile("{ .reg .b64 state; mbarrier.arrive.shared::cta.b64 state, [%0]; }" ::"r"(smem_addr(bar))
                     : "memory");
}

// One arrival for the calling warp, after all its lanes' earlier shared-memory accesses.
__device__ __forceinline__ void warp_arrive(u64* bar) {
    __syncwarp();
    lane0_arrive(bar);
}

__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, %0;" ::"n"(CONSUMERS * 32) : "memory"); }

// Producer warp p: tile column jt (the block's p % 8th), ring stages i = p / 8 (mod K_TURNS) of STAGE_KT k-tiles
// each (k-tiles kt_begin + STAGE_KT i + t), decoded into ring stage i % STAGES.
__device__ __forceinline__ void produce(u32* ring, u64* full, u64* empty, const u32* __restrict__ words, int tiles_n,
                                       int jt, int kt_begin, int kt_end, int p) {
    using T = Trellis<K2, CB>;
    const int lane = threadIdx.x & 31;
    const int turn = p / WS_TILES, mine = (kt_end - kt_begin) / (STAGE_KT * K_TURNS);   // k ranges: whole chunks
    const size_t k_tile = (size_t)tiles_n * T::WT, k_step = k_tile * STAGE_KT * K_TURNS;
    WordStream<T> stream(words, jt, (kt_begin + STAGE_KT * turn) * k_tile);
    const u32 sh = stream.shift;
    u32 buf[PF_STAGES][STAGE_KT][T::NW];
#pragma unroll
    for (int q = 0; q < PF_STAGES; q++) {
#pragma unroll
        for (int t = 0; t < STAGE_KT; t++) stream.load(buf[q][t], t * k_tile);
        if (q + 1 < mine) stream.advance(k_step);
    }
    for (int j0 = 0; j0 < mine; j0 += PF_STAGES) {
#pragma unroll
        for (int q = 0; q < PF_STAGES; q++) {
            const int j = j0 + q;
            const u32 i = j * K_TURNS + turn, s = i % STAGES;
            u32 b[STAGE_KT][4];
#pragma unroll
            for (int t = 0; t < STAGE_KT; t++) {
                T::decode_tile(buf[q][t], sh, b[t]);
                stream.load(buf[q][t], t * k_tile);
            }
            if (j + PF_STAGES + 1 < mine) stream.advance(k_step);
            mbar_wait(empty + s, ((i / STAGES) & 1) ^ 1);
            // Fragment b[t][f] of every lane is one 8 x 8 core matrix of k-tile t (n-octet 2 jt + f / 2, k-octet
            // f % 2), 128 bytes.
            u32* dst = ring + s * STAGE_U32 + (p % WS_TILES) * 128 + lane;
#pragma unroll
            for (int t = 0; t < STAGE_KT; t++)
#pragma unroll
                for (int f = 0; f < 4; f++) dst[t * KTILE_U32 + 32 * f] = b[t][f];
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");   // visible to the tensor cores' reads
            warp_arrive(full + s);
        }
    }
}

// Byte offset of (row, 16-byte piece p of its 128 inputs) in a staged chunk for wgmma's 128-byte swizzle: two
// halves of 64 inputs, each 128 rows of 128 bytes whose pieces are permuted by row % 8 (1024-byte aligned).
__device__ __forceinline__ u32 x_swizzled_offset(int row, int p) {
    return (p >> 3) * (WS_ROWS * 128) + row * 128 + (((p & 7) ^ (row & 7)) << 4);
}
constexpr u32 ROWS32_BYTES = 32 * 128;                 // 32 rows further in the staged chunk

// Consumer thread ct's part of staging x: rows first_row + 32 i (i < 4) of the block, 8 inputs from column col.
struct XStager {
    const unsigned short* src;   // x row m0 + first_row, column col
    u32 dst, row_step;           // shared address of (first_row, col) in a chunk buffer; 32 rows of x, in bytes
    int live;                    // rows first_row + 32 i with i < live exist

    __device__ XStager(const unsigned short* x, unsigned short* xs, int m0, int block_rows, int stride_x, int ct) {
        const int first_row = ct >> 4, col = (ct & 15) * 8;
        dst = smem_addr(xs) + x_swizzled_offset(first_row, ct & 15);   // eight threads fill one 128-byte row
        src = x + (size_t)(m0 + (first_row < block_rows ? first_row : 0)) * stride_x + col;
        row_step = 32u * stride_x * 2u;
        live = (block_rows - first_row + 31) / 32;
    }

    // Chunk c0 (128 inputs from k-tile c0) into buffer buf; rows past the block read as 0.
    __device__ __forceinline__ void stage(int c0, int buf) const {
        const char* p = reinterpret_cast<const char*>(src + c0 * 16);
        const u32 d = dst + buf * XS_BYTES;
#pragma unroll
        for (int i = 0; i < WS_ROWS / 32; i++)
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d + i * ROWS32_BYTES),
                         "l"(p + (i < live ? i * row_step : 0)), "r"(i < live ? 16 : 0) : "memory");
        asm volatile("cp.async.commit_group;" ::: "memory");
    }
};

// wgmma shared-memory descriptors (low word: start address, leading offset; high word: stride offset, layout).
// Ring stages: K-major core matrices without swizzle, k-octets 128 bytes apart, column octets 256 bytes apart.
__device__ __forceinline__ u32 ring_descriptor(u32 addr) { return ((addr >> 4) & 0x3FFF) | ((128 >> 4) << 16); }
constexpr u32 RING_DESC_HI = 256 >> 4;
// Staged x: 128-byte swizzle, row octets 1024 bytes apart.
__device__ __forceinline__ u32 x_descriptor(u32 addr) { return ((addr >> 4) & 0x3FFF) | (1u << 16); }
constexpr u32 X_DESC_HI = (1024 >> 4) | (1u << 30);

// d += A (k16 of 64 x rows at desc_a) x B (k16 x n64 at desc_b), one wgmma with both operands in shared memory.
__device__ __forceinline__ void wgmma_64x64(float (&d)[1][4][2][4], u32 desc_a, u32 desc_b) {
    float* v = &d[0][0][0][0];
    u64 a, b;
    asm("mov.b64 %0, {%1, %2};" : "=l"(a) : "r"(desc_a), "r"(X_DESC_HI));
    asm("mov.b64 %0, {%1, %2};" : "=l"(b) : "r"(desc_b), "r"(RING_DESC_HI));
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, "
                 "%11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, "
                 "%31}, %32, %33, 1, 1, 1, 0, 0;"
                 : "+f"(v[0]), "+f"(v[1]), "+f"(v[2]), "+f"(v[3]), "+f"(v[4]), "+f"(v[5]), "+f"(v[6]), "+f"(v[7]),
                   "+f"(v[8]), "+f"(v[9]), "+f"(v[10]), "+f"(v[11]), "+f"(v[12]), "+f"(v[13]), "+f"(v[14]),
                   "+f"(v[15]), "+f"(v[16]), "+f"(v[17]), "+f"(v[18]), "+f"(v[19]), "+f"(v[20]), "+f"(v[21]),
                   "+f"(v[22]), "+f"(v[23]), "+f"(v[24]), "+f"(v[25]), "+f"(v[26]), "+f"(v[27]), "+f"(v[28]),
                   "+f"(v[29]), "+f"(v[30]), "+f"(v[31])
                 : "l"(a), "l"(b));
}

template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory"); }

extern "C" __global__ void __launch_bounds__(WS_THREADS, 1)
trellis_ws(const unsigned short* __restrict__ x, const u32* __restrict__ words, float* __restrict__ part,
           const unsigned short* __restrict__ svh, const unsigned short* __restrict__ bias, void* __restrict__ out,
           int out_dtype, int* __restrict__ counters, int rows, int n, int tiles_n, int ktiles_total,
           int ktiles_per_split, int stride_x, int stride_out, int splits, int splits_per_block) {
    extern __shared__ __align__(16) unsigned char smem[];
    u32* ring = reinterpret_cast<u32*>(smem);
    unsigned char* xs_at = smem + STAGES * STAGE_U32 * 4;
    xs_at += (1024 - (smem_addr(xs_at) & 1023)) & 1023;   // swizzle atoms start 1024-byte aligned
    unsigned short* xs = reinterpret_cast<unsigned short*>(xs_at);
    float* total = reinterpret_cast<float*>(xs_at + 2 * XS_BYTES);
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
        // Consumer warpgroup c: block rows 64 (c & 1) + [0, 64), columns 64 (c >> 1) + [0, 64); warp w: 16 of the rows.
        const int c = (warp - PRODUCERS) >> 2, row0 = 64 * (c & 1) + 16 * (warp & 3), ct = threadIdx.x - PRODUCERS * 32;
        const int my_rows = block_rows - row0;
        const int jt0 = blockIdx.x * WS_TILES + 4 * (c >> 1);
        const u32 desc_x = x_descriptor(smem_addr(xs) + 64 * (c & 1) * 128);
        const u32 desc_w = ring_descriptor(smem_addr(ring + (c >> 1) * 4 * 128));
        float acc[1][4][2][4];
        zero_acc(acc);
        const XStager stager(x, xs, m0, block_rows, stride_x, ct);
        stager.stage(kt_begin, 0);
        u32 st = 0, phase = 0, held = 0;   // ring stage of the next k-tile, its phase parity, the stage in use
        for (int split = split0; split < split1; split++) {
            const int kt0 = split * ktiles_per_split, kt1 = min(kt0 + ktiles_per_split, ktiles_total);
            bool holding = false;
            for (int c0 = kt0; c0 < kt1; c0 += CHUNK) {
                const int buf = ((c0 - kt_begin) / CHUNK) & 1;
                wgmma_wait<0>();   // the tensor cores are done reading the other buffer
                asm volatile("cp.async.wait_group 0;" ::: "memory");            // this chunk's rows landed
                asm volatile("fence.proxy.async.shared::cta;" ::: "memory");   // visible to the tensor cores
                consumers_sync();  // every consumer's rows are in xs[buf], and none reads xs[buf ^ 1]
                if (c0 + CHUNK < kt_end) stager.stage(c0 + CHUNK, buf ^ 1);
#pragma unroll
                for (int q = 0; q < CHUNK / STAGE_KT; q++) {
                    mbar_wait(full + st, phase);
                    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
                    for (int t = 0; t < STAGE_KT; t++) {
                        const int s = STAGE_KT * q + t;   // k-tile within the chunk
                        wgmma_64x64(acc, desc_x + ((buf * XS_BYTES + (s >> 2) * WS_ROWS * 128 + (s & 3) * 32) >> 4),
                                    desc_w + ((st * STAGE_U32 + t * KTILE_U32) * 4 >> 4));
                    }
                    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
                    wgmma_wait<1>();   // the previous stage's wgmmas are done with it
                    if (holding) lane0_arrive(empty + held);
                    held = st;
                    holding = true;
                    if (++st == STAGES) {
                        st = 0;
                        phase ^= 1;
                    }
                }
            }
            wgmma_wait<0>();
            if (holding) lane0_arrive(empty + held);
            if (whole) {
                // total = ((0 + p0) + p1) + ...: each thread adds its own elements, where store_partials puts them.
                const int g = lane >> 2, t4 = lane & 3;
#pragma unroll
                for (int nt = 0; nt < 4; nt++)
#pragma unroll
                    for (int h = 0; h < 2; h++)
#pragma unroll
                        for (int half = 0; half < 2; half++) {
                            const int r = row0 + g + 8 * half, col = (4 * (c >> 1) + nt) * 16 + h * 8 + 2 * t4;
                            float2& t = *reinterpret_cast<float2*>(total + r * TOTAL_STRIDE + col);
                            const float2 before = split == split0 ? make_float2(0.f, 0.f) : t;
                            t = make_float2(before.x + acc[0][nt][h][2 * half], before.y + acc[0][nt][h][2 * half + 1]);
                        }
            } else if (my_rows > 0) {
                store_partials(acc, part + ((size_t)split * rows + m0 + row0) * n, n, my_rows, jt0);
            }
            zero_acc(acc);
        }
    }
    constexpr int WARPS_ALL = PRODUCERS + CONSUMERS;
    if (whole) {
        __syncthreads();
        auto sum = [&](float (&v)[4], int r) {
            const float4 q = *reinterpret_cast<const float4*>(total + r * TOTAL_STRIDE + 4 * lane);
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
