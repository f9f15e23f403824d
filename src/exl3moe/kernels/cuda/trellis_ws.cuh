// Warp-specialized trellis matmul for blocks of 128 rows on sm_90a (shared by trellis_ws.cu and moe_mma.cu):
// producer warps decode the 8 n16 tiles of a 128-column block into a ring of shared-memory stages (the mma.sync B
// fragments trellis_mma decodes, stored as wgmma core matrices), and a consumer warpgroup per 64 rows (64 rows x 128
// columns each) runs wgmma on them (two m64n64k16 per k-tile, or one m64n128k16 with paired producers), with x
// staged in the 128-byte swizzle (cp.async, or TMA). A k16 step sums to the same bits on wgmma as on mma.sync, and
// every output element gets the same products in the same order as in mma_mainloop. Compile-time (-D): PF (k-tiles
// of words prefetched per producer), STAGES (ring stages of STAGE_KT k-tiles), X_TMA (x chunks by the tensor memory
// accelerator), WS_PRODUCERS (16, or 12 paired producers), WS_BLOCK_ROWS (192: three warpgroups, 8 paired producers).
#pragma once
#include "trellis_core.cuh"
#ifndef X_TMA
#define X_TMA 0   // 1: one consumer thread asks TMA for each x chunk (a tensor map of x's rows), onto a barrier
#endif
#ifndef WS_PRODUCERS
#define WS_PRODUCERS 16   // 12 (8 with 192-row blocks): paired producers, each decoding two tile columns
#endif
#ifndef WS_BLOCK_ROWS
#define WS_BLOCK_ROWS 128   // 192: three consumer warpgroups
#endif

constexpr int WS_ROWS = WS_BLOCK_ROWS, WS_TILES = 8;
constexpr int PRODUCERS = WS_PRODUCERS, PRODUCER_COLS = PRODUCERS == 16 ? 1 : 2;   // tile columns per producer
constexpr int TURN_WARPS = WS_TILES / PRODUCER_COLS, K_TURNS = PRODUCERS / TURN_WARPS;   // stages taken in turns
static_assert(WS_ROWS == 128 ? PRODUCERS == 16 || PRODUCERS == 12 : WS_ROWS == 192 && PRODUCERS == 8,
              "128-row blocks: 16 producers of one column or 12 of two; 192-row blocks: 8 of two");
// ptxas gives m64n128k16's 64 accumulators 90 registers at the block's entry, which 768 threads do not have.
constexpr int WGMMA_N = PRODUCERS == 16 ? 64 : 128;
constexpr int CONSUMERS = WS_ROWS / 16;                 // a warpgroup per 64 rows
constexpr int WS_THREADS = (PRODUCERS + CONSUMERS) * 32;
#ifndef STAGE_KT
#define STAGE_KT 4                                      // k-tiles per ring stage
#endif
constexpr int PF_STAGES = PF > STAGE_KT ? PF / STAGE_KT : 1;   // stages of words prefetched (stages below a chunk)
// Stages of a whole chunk, or any stages of paired producers: a range's stage count need not divide among the
// turns, and each producer waits for its stage before it decodes one k-tile at a time into it (the registers of one
// k-tile's fragments).
constexpr bool WHOLE_CHUNK_STAGES = STAGE_KT * K_TURNS > CHUNK;
static_assert(WHOLE_CHUNK_STAGES ? STAGE_KT % PF == 0 && (STAGE_KT == CHUNK || PRODUCER_COLS > 1)
                                 : PF % STAGE_KT == 0 && (CHUNK / (STAGE_KT * K_TURNS)) % PF_STAGES == 0,
              "a producer's stages of a chunk: whole prefetch rounds");

// Producer warp p's first tile column of a block (its PRODUCER_COLS columns follow).
__device__ __forceinline__ int producer_column(int p) { return (p % TURN_WARPS) * PRODUCER_COLS; }
constexpr int KTILE_U32 = WS_TILES * 32 * 4;          // one k-tile of the block: 8 tiles x 32 lanes x 4 fragments
constexpr int STAGE_U32 = STAGE_KT * KTILE_U32;
constexpr u32 XS_BYTES = WS_ROWS * 256;                // one staged x chunk (WS_ROWS rows x 128 inputs), 1024-aligned
#ifndef WS_DIAG
// Timing builds only (wrong results; scripts/ws_diag.sh): 1 no wgmma, 2 no decode, 4 no x staging, 8 no producer
// proxy fence, 16 no trellis loads after the first, 32 no ring stores.
#define WS_DIAG 0
#endif
#ifndef WS_TRACE
#define WS_TRACE 0                                      // timing builds: block 0 records ring events (ws_trace)
#endif
#if WS_TRACE
constexpr int TRACE_EVENTS = 1024;
__device__ u32 ws_trace_events[32][2 * TRACE_EVENTS];
__device__ __forceinline__ int& ws_trace_count(int warp) {
    __shared__ int count[32];
    return count[warp];
}
__device__ __forceinline__ bool ws_traced_lane() {   // lane 0 of each warp of block 0
    return (threadIdx.x & 31) == 0 && blockIdx.x + blockIdx.y + blockIdx.z == 0;
}
#endif

// Lane 0 of block 0's warps notes (code, clock) in order (code 0 starts the warp's list); ws_trace_print writes them.
__device__ __forceinline__ void ws_trace(int code) {
#if WS_TRACE
    if (ws_traced_lane()) {
        const int warp = threadIdx.x >> 5;
        int& n = ws_trace_count(warp);
        if (code == 0) n = 0;
        if (n < TRACE_EVENTS) {
            ws_trace_events[warp][2 * n] = code;
            ws_trace_events[warp][2 * n + 1] = (u32)clock();
            n++;
        }
    }
#endif
}

__device__ __forceinline__ void ws_trace_print() {
#if WS_TRACE
    const int warp = threadIdx.x >> 5;
    if (!ws_traced_lane()) return;
    const u32* e = ws_trace_events[warp];
    for (int i = 0; i < ws_trace_count(warp); i += 4)
        printf("WS %d %d %u %u %u %u %u %u %u %u\n", warp, i, e[2 * i], e[2 * i + 1], e[2 * i + 2], e[2 * i + 3],
               e[2 * i + 4], e[2 * i + 5], e[2 * i + 6], e[2 * i + 7]);
#endif
}

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

// Register budgets per role: a block starts at ENTRY_REGS per thread, producers give some back and the consumer
// warpgroups take them for their 64 accumulators; both return to ENTRY_REGS before code that every warp runs.
constexpr int ENTRY_REGS = (65536 / WS_THREADS) & ~7;
constexpr int PRODUCER_REGS = PRODUCERS == 16 ? 72 : PRODUCERS == 12 ? 88 : 80;
constexpr int CONSUMER_REGS = PRODUCERS == 16 ? 96 : 104;
static_assert(PRODUCERS * PRODUCER_REGS + CONSUMERS * CONSUMER_REGS <= (PRODUCERS + CONSUMERS) * ENTRY_REGS,
              "register budget of a block");
template <bool consumer, bool begin>
__device__ __forceinline__ void role_registers() {
    if constexpr (consumer == begin)
        asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(begin ? CONSUMER_REGS : ENTRY_REGS));
    else
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(begin ? PRODUCER_REGS : ENTRY_REGS));
}

// The block's two roles: producer warps run produce(cursor) (a ring cursor from 0), consumer warps consume(), each
// with its role's registers; both leave with the entry count.
template <class Produce, class Consume>
__device__ __forceinline__ void ws_roles(Produce&& produce, Consume&& consume) {
    if ((threadIdx.x >> 5) < PRODUCERS) {
        role_registers<false, true>();
        u32 cursor = 0;
        produce(cursor);
        role_registers<false, false>();
        return;
    }
    role_registers<true, true>();
    consume();
    role_registers<true, false>();
}

__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, %0;" ::"n"(CONSUMERS * 32) : "memory"); }

#ifndef RACECHECK_ORDER
// Sanitizer builds: the producers of one tile column (one per turn) also pass each ring stage of a range together
// at a named barrier, an order racecheck sees; the ring's mbarrier parity waits order them anyway. The consumers pass
// as many barriers (Consumer::run): racecheck behaves as if it ordered accesses by each thread's count of barriers of
// any id, and reported last_arrival's flag, which bar.sync 0 orders, where the counts differed (docs/DESIGN.md).
#define RACECHECK_ORDER 0
#endif
constexpr int TURN_BARRIER0 = 2;   // named barriers 0 (__syncthreads) and 1 (consumers_sync) are taken
static_assert(TURN_BARRIER0 + TURN_WARPS <= 16 && TURN_WARPS <= 8, "a named barrier per producer column");

template <int column>
__device__ __forceinline__ void turn_barrier() {   // an immediate barrier id, as the tool reads it
    asm volatile("bar.sync %0, %1;" ::"n"(TURN_BARRIER0 + column), "n"(K_TURNS * 32) : "memory");
}

// RACECHECK_ORDER: producer warp p meets the other turns' producers of its columns once for each of the range's ring
// stages `passed`..`upto` - 1 (every producer meets once per stage, whichever turn writes it).
__device__ __forceinline__ void turns_meet(int p, int& passed, int upto) {
    if constexpr (RACECHECK_ORDER) {
        for (; passed < upto; passed++) {
            switch (p % TURN_WARPS) {
                case 0: turn_barrier<0>(); break;
                case 1: turn_barrier<1>(); break;
                case 2: turn_barrier<2>(); break;
                case 3: turn_barrier<3>(); break;
                case 4: turn_barrier<4 % TURN_WARPS>(); break;
                case 5: turn_barrier<5 % TURN_WARPS>(); break;
                case 6: turn_barrier<6 % TURN_WARPS>(); break;
                default: turn_barrier<7 % TURN_WARPS>(); break;
            }
        }
    }
}

// The words of a producer's PRODUCER_COLS tile columns (adjacent in the trellis) of the k-tile `offset` words on.
template <class T>
__device__ __forceinline__ void load_columns(const WordStream<T>& stream, u32 (&w)[PRODUCER_COLS][T::NW],
                                             size_t offset) {
#pragma unroll
    for (int c = 0; c < PRODUCER_COLS; c++) stream.load(w[c], offset + c * T::WT);
}

// produce's whole-chunk stages: each waits for its ring stage, then decodes and stores one k-tile at a time, with
// the words of the producer's next PF k-tiles in flight.
template <class T>
__device__ __forceinline__ void produce_whole_chunks(u32* ring, u64* full, u64* empty, WordStream<T>& stream,
                                                     size_t k_tile, size_t k_step, int p, int turn, int mine,
                                                     u32 cursor, int stages) {
    constexpr int ROLL = PF;
    const u32 sh = stream.shift;
    u32 buf[ROLL][PRODUCER_COLS][T::NW];
    int passed = 0;   // RACECHECK_ORDER: the range's stages this warp has met the other turns for
#pragma unroll
    for (int t = 0; t < ROLL; t++)
        if (mine > 0) load_columns(stream, buf[t], t * k_tile);
    for (int j = 0; j < mine; j++) {
        const u32 i = cursor + j * K_TURNS + turn, s = i % STAGES;
        u32* dst = ring + s * STAGE_U32 + producer_column(p) * 128 + (threadIdx.x & 31);   // as in produce
        turns_meet(p, passed, j * K_TURNS + turn);
        ws_trace(1);
        mbar_wait(empty + s, ((i / STAGES) & 1) ^ 1);
        ws_trace(2);
#pragma unroll
        for (int t = 0; t < STAGE_KT; t++) {
            u32 b[PRODUCER_COLS][4];
#pragma unroll
            for (int c = 0; c < PRODUCER_COLS; c++) {
                if (WS_DIAG & 2) {
#pragma unroll
                    for (int f = 0; f < 4; f++) b[c][f] = buf[t % ROLL][c][f % T::NW];
                } else {
                    T::decode_tile(buf[t % ROLL][c], sh, b[c]);
                }
            }
            if (WS_DIAG & 16) {
            } else if (t + ROLL < STAGE_KT) {
                load_columns(stream, buf[t % ROLL], (t + ROLL) * k_tile);
            } else if (j + 1 < mine) {
                load_columns(stream, buf[t % ROLL], k_step + (t + ROLL - STAGE_KT) * k_tile);
            }
#pragma unroll
            for (int c = 0; c < PRODUCER_COLS; c++)
#pragma unroll
                for (int f = 0; f < 4; f++)
                    if (!(WS_DIAG & 32)) dst[t * KTILE_U32 + c * 128 + 32 * f] = b[c][f];   // ordered as produce's
        }
        stream.advance(k_step);
        if (!(WS_DIAG & 8))
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");   // visible to the tensor cores' reads
        warp_arrive(full + s);
        turns_meet(p, passed, j * K_TURNS + turn + 1);
        ws_trace(3);
    }
    turns_meet(p, passed, stages);
}

// Producer warp p: tile columns jt.. (the block's producer_column(p)th and the PRODUCER_COLS - 1 after it) of the
// (2K, codebook) trellis `words`, ring stages cursor + i for i = p / TURN_WARPS (mod K_TURNS) of STAGE_KT k-tiles
// each (k-tiles kt_begin + STAGE_KT i + t), decoded into ring stage (cursor + i) % STAGES; cursor counts the stages
// the block's earlier ranges used.
template <int K2_, int CB_>
__device__ __forceinline__ void produce(u32* ring, u64* full, u64* empty, const u32* __restrict__ words, int tiles_n,
                                       int jt, int kt_begin, int kt_end, int p, u32 cursor) {
    using T = Trellis<K2_, CB_>;
    const int lane = threadIdx.x & 31;
    const int turn = p / TURN_WARPS, stages = (kt_end - kt_begin) / STAGE_KT;   // k ranges: whole chunks
    const int mine = WHOLE_CHUNK_STAGES ? (stages + K_TURNS - 1 - turn) / K_TURNS : stages / K_TURNS;
    const size_t k_tile = (size_t)tiles_n * T::WT, k_step = k_tile * STAGE_KT * K_TURNS;
    WordStream<T> stream(words, jt, (kt_begin + STAGE_KT * turn) * k_tile);
    const u32 sh = stream.shift;
    if constexpr (WHOLE_CHUNK_STAGES) {
        produce_whole_chunks<T>(ring, full, empty, stream, k_tile, k_step, p, turn, mine, cursor, stages);
        return;
    }
    u32 buf[PF_STAGES][STAGE_KT][T::NW];
    int passed = 0;   // RACECHECK_ORDER: the range's stages this warp has met the other turns for
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
            const u32 i = cursor + j * K_TURNS + turn, s = i % STAGES;
            u32 b[STAGE_KT][4];
#pragma unroll
            for (int t = 0; t < STAGE_KT; t++) {
                if (WS_DIAG & 2) {
#pragma unroll
                    for (int f = 0; f < 4; f++) b[t][f] = buf[q][t][f % T::NW];
                } else {
                    T::decode_tile(buf[q][t], sh, b[t]);
                }
                if (!(WS_DIAG & 16)) stream.load(buf[q][t], t * k_tile);
            }
            if (j + PF_STAGES + 1 < mine) stream.advance(k_step);
            turns_meet(p, passed, j * K_TURNS + turn);
            ws_trace(1);
            mbar_wait(empty + s, ((i / STAGES) & 1) ^ 1);
            ws_trace(2);
            // Fragment b[t][f] of every lane is one 8 x 8 core matrix of k-tile t (n-octet 2 jt + f / 2, k-octet
            // f % 2), 128 bytes.
            u32* dst = ring + s * STAGE_U32 + producer_column(p) * 128 + lane;
            // After the slot's last use by mbarrier parity: full, consumers' wgmma wait, empty (see RACECHECK_ORDER).
#pragma unroll
            for (int t = 0; t < STAGE_KT; t++)
#pragma unroll
                for (int f = 0; f < 4; f++)
                    if (!(WS_DIAG & 32)) dst[t * KTILE_U32 + 32 * f] = b[t][f];
            if (!(WS_DIAG & 8))
                asm volatile("fence.proxy.async.shared::cta;" ::: "memory");   // visible to the tensor cores' reads
            warp_arrive(full + s);
            turns_meet(p, passed, j * K_TURNS + turn + 1);
            ws_trace(3);
        }
    }
    turns_meet(p, passed, stages);
}

// Byte offset of (row, 16-byte piece p of its 128 inputs) in a staged chunk for wgmma's 128-byte swizzle: two
// halves of 64 inputs, each WS_ROWS rows of 128 bytes whose pieces are permuted by row % 8 (1024-byte aligned).
__device__ __forceinline__ u32 x_swizzled_offset(int row, int p) {
    return (p >> 3) * (WS_ROWS * 128) + row * 128 + (((p & 7) ^ (row & 7)) << 4);
}
#if X_TMA
struct alignas(64) XMap { unsigned long long words[16]; };   // a CUtensorMap: x's rows, boxes of WS_ROWS rows x 64

// Rows of x: tensor-map rows from `row`; a kernel's tensor map is a __grid_constant__ parameter.
struct XSource {
    const XMap* map;
    int row;
};
#define X_MAP_PARAM , const __grid_constant__ XMap x_map   // the last parameter of a kernel whose x goes by TMA
#define X_ROWS(x, row, stride) (XSource{&x_map, (int)(row)})   // rows of x from `row` (its row stride `stride`)

// The consumers' x chunks: the first consumer thread asks TMA for a chunk's two 64-input halves, which land in the
// 128-byte swizzle (rows past the block are those that follow in x, or 0 past its end: no output reads them) and
// complete on the buffer's barrier.
struct XStager {
    unsigned long long map;
    int row;
    u32 dst, bars;
    bool issuer;

    __device__ XStager(XSource src, unsigned short* xs, u64* x_full, int m0, int block_rows, int ct)
        : map(reinterpret_cast<unsigned long long>(src.map)), row(src.row + m0), dst(smem_addr(xs)),
          bars(smem_addr(x_full)), issuer(ct == 0) {}

    // Chunk c0 (128 inputs from k-tile c0) into buffer buf.
    __device__ __forceinline__ void stage(int c0, int buf) const {
        if (!issuer) return;
        const u32 bar = bars + buf * 8;
        if (WS_DIAG & 4) {   // no x: the buffer's phase completes on the arrival alone
            asm volatile("{ .reg .b64 state; mbarrier.arrive.shared::cta.b64 state, [%0]; }" ::"r"(bar) : "memory");
            return;
        }
        asm volatile("{ .reg .b64 state; mbarrier.arrive.expect_tx.shared::cta.b64 state, [%0], %1; }"
                     ::"r"(bar), "r"(XS_BYTES) : "memory");
#pragma unroll
        for (int h = 0; h < 2; h++)
            asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, "
                         "%3}], [%4];" ::"r"(dst + buf * XS_BYTES + h * WS_ROWS * 128), "l"(map), "r"(c0 * 16 + h * 64),
                         "r"(row), "r"(bar) : "memory");
    }

    // Waits until chunk `chunk` (buffer chunk % 2, its use chunk / 2) has landed.
    __device__ __forceinline__ void wait(u32 chunk, u64* x_full) const {
        mbar_wait(x_full + (chunk & 1), (chunk >> 1) & 1);
    }
};
#else
// Rows of x: x + row * stride.
struct XSource {
    const unsigned short* x;
    int stride;
};
#define X_MAP_PARAM
#define X_ROWS(x, row, stride) (XSource{(x) + (size_t)(row) * (stride), (stride)})

constexpr int XS_PASS_ROWS = CONSUMERS * 2;            // rows the consumer threads stage in one pass

// Consumer thread ct's part of staging x: rows first_row + XS_PASS_ROWS i of the block, 8 inputs from column col.
struct XStager {
    const unsigned short* src;   // x row m0 + first_row, column col
    u32 dst, row_step;           // shared address of (first_row, col) in a chunk buffer; a pass of rows of x, in bytes
    int live;                    // rows first_row + XS_PASS_ROWS i with i < live exist

    __device__ XStager(XSource x, unsigned short* xs, u64*, int m0, int block_rows, int ct) {
        const int first_row = ct >> 4, col = (ct & 15) * 8;
        dst = smem_addr(xs) + x_swizzled_offset(first_row, ct & 15);   // eight threads fill one 128-byte row
        src = x.x + (size_t)(m0 + (first_row < block_rows ? first_row : 0)) * x.stride + col;
        row_step = (u32)XS_PASS_ROWS * x.stride * 2u;
        live = (block_rows - first_row + XS_PASS_ROWS - 1) / XS_PASS_ROWS;
    }

    // Chunk c0 (128 inputs from k-tile c0) into buffer buf; rows past the block read as 0.
    __device__ __forceinline__ void stage(int c0, int buf) const {
        const char* p = reinterpret_cast<const char*>(src + c0 * 16);
        const u32 d = dst + buf * XS_BYTES;
#pragma unroll
        for (int i = 0; i < (WS_DIAG & 4 ? 0 : WS_ROWS / XS_PASS_ROWS); i++)
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d + i * XS_PASS_ROWS * 128),
                         "l"(p + (i < live ? i * row_step : 0)), "r"(i < live ? 16 : 0) : "memory");
        asm volatile("cp.async.commit_group;" ::: "memory");
    }

    // Waits until this thread's rows of the last chunk staged have landed, visible to the tensor cores.
    __device__ __forceinline__ void wait(u32, u64*) const {
        asm volatile("cp.async.wait_group 0;" ::: "memory");
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    }
};
#endif

// wgmma shared-memory descriptors (low word: start address, leading offset; high word: stride offset, layout).
// Ring stages: K-major core matrices without swizzle, k-octets 128 bytes apart, column octets 256 bytes apart.
__device__ __forceinline__ u32 ring_descriptor(u32 addr) { return ((addr >> 4) & 0x3FFF) | ((128 >> 4) << 16); }
constexpr u32 RING_DESC_HI = 256 >> 4;
// Staged x: 128-byte swizzle, row octets 1024 bytes apart.
__device__ __forceinline__ u32 x_descriptor(u32 addr) { return ((addr >> 4) & 0x3FFF) | (1u << 16); }
constexpr u32 X_DESC_HI = (1024 >> 4) | (1u << 30);

// Inline-asm pieces of a wgmma with both operands in shared memory: accumulator placeholders %0..%31 and %32..%63,
// and read-write bindings of v[i..i + 8).
#define WGMMA_ACC_0_31 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, " \
    "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define WGMMA_ACC_32_63 ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, " \
    "%50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define WGMMA_BIND8(i) "+f"(v[i]), "+f"(v[i + 1]), "+f"(v[i + 2]), "+f"(v[i + 3]), "+f"(v[i + 4]), "+f"(v[i + 5]), \
    "+f"(v[i + 6]), "+f"(v[i + 7])

// The 64-bit shared-memory descriptors of x (A) at desc_a and of a ring stage (B) at desc_b.
__device__ __forceinline__ void wgmma_descriptors(u32 desc_a, u32 desc_b, u64& a, u64& b) {
    asm("mov.b64 %0, {%1, %2};" : "=l"(a) : "r"(desc_a), "r"(X_DESC_HI));
    asm("mov.b64 %0, {%1, %2};" : "=l"(b) : "r"(desc_b), "r"(RING_DESC_HI));
}

// v[0..32) += A (k16 of 64 x rows at desc_a) x B (k16 x n64 at desc_b), one wgmma with both operands in shared
// memory; v is the mma.sync accumulator layout of 4 n16 tiles.
__device__ __forceinline__ void wgmma_64x64(float* v, u32 desc_a, u32 desc_b) {
    u64 a, b;
    wgmma_descriptors(desc_a, desc_b, a, b);
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {" WGMMA_ACC_0_31 "}, %32, %33, 1, 1, 1, 0, 0;"
                 : WGMMA_BIND8(0), WGMMA_BIND8(8), WGMMA_BIND8(16), WGMMA_BIND8(24)
                 : "l"(a), "l"(b));
}

// v[0..64) += A (k16 of 64 x rows at desc_a) x B (k16 x n128 at desc_b): wgmma_64x64's two halves in one.
__device__ __forceinline__ void wgmma_64x128(float* v, u32 desc_a, u32 desc_b) {
    u64 a, b;
    wgmma_descriptors(desc_a, desc_b, a, b);
    asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {" WGMMA_ACC_0_31 WGMMA_ACC_32_63 "}, %64, %65, "
                 "1, 1, 1, 0, 0;"
                 : WGMMA_BIND8(0), WGMMA_BIND8(8), WGMMA_BIND8(16), WGMMA_BIND8(24), WGMMA_BIND8(32), WGMMA_BIND8(40),
                   WGMMA_BIND8(48), WGMMA_BIND8(56)
                 : "l"(a), "l"(b));
}

template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory"); }


using WsAcc = float[1][8][2][4];   // a consumer thread's accumulators: 16 rows x 128 columns of its warp

// The calling consumer warp's warpgroup c, from lane 0 so the compiler knows it is warp-uniform and keeps descriptor
// arithmetic on uniform registers; c has block rows 64 c + [0, 64), and consumer_row0() is its warp's first of them.
__device__ __forceinline__ int consumer_group() {
    return __shfl_sync(0xffffffffu, ((threadIdx.x >> 5) - PRODUCERS) >> 2, 0);
}
__device__ __forceinline__ int consumer_row0() { return 64 * consumer_group() + 16 * ((threadIdx.x >> 5) & 3); }

// A consumer warpgroup of a block: its 64 rows by the block's 128 columns. It walks the ring in order (st, phase)
// and stages x chunks into alternating buffers (the caller stages a range's first chunk with stage_first); a
// warpgroup whose rows are all past the block's runs no wgmma (its accumulators stay as they are).
struct Consumer {
    XStager stager;
    u32 desc_x, desc_w, st, phase, held, chunk;
    bool has_rows;
    u64* x_full;   // the x buffers' barriers (X_TMA)

    __device__ Consumer(XSource x, unsigned short* xs, u32* ring, u64* x_full, int m0, int block_rows)
        : stager(x, xs, x_full, m0, block_rows, threadIdx.x - PRODUCERS * 32), st(0), phase(0), held(0), chunk(0),
          x_full(x_full) {
        const int group = consumer_group();
        desc_x = x_descriptor(smem_addr(xs) + group * 64 * 128);
        desc_w = ring_descriptor(smem_addr(ring));
        has_rows = runs_wgmma(block_rows, group);
    }

    // Whether warpgroup `group` has rows of a block of block_rows (and the build keeps its wgmma).
    __device__ static __forceinline__ bool runs_wgmma(int block_rows, int group) {
        return block_rows > 64 * group && !(WS_DIAG & 1);
    }

    // Stage the rows of another block from now on; the walk of the ring and of the x buffers carries on.
    __device__ __forceinline__ void retarget(XSource x, unsigned short* xs, int m0, int block_rows) {
        stager = XStager(x, xs, x_full, m0, block_rows, threadIdx.x - PRODUCERS * 32);
        has_rows = runs_wgmma(block_rows, consumer_group());
    }

    __device__ __forceinline__ void stage_first(int kt) const { stager.stage(kt, chunk & 1); }

    // acc += x[:, k-tiles kt0..kt1) @ W of the ring's next stages; chunk next_kt (if >= 0) is staged meanwhile.
    __device__ __forceinline__ void run(WsAcc& acc, u64* full, u64* empty, int kt0, int kt1, int next_kt) {
        bool holding = false;
        for (int c0 = kt0; c0 < kt1; c0 += CHUNK, chunk++) {
            const u32 buf = chunk & 1, x_chunk = desc_x + buf * (XS_BYTES >> 4);
            wgmma_wait<0>();   // the tensor cores are done reading the other buffer
            if (!X_TMA) stager.wait(chunk, x_full);   // this thread's rows of the chunk landed
            consumers_sync();  // every consumer's rows are in xs[buf], and none reads xs[buf ^ 1]
            // RACECHECK_ORDER: a barrier per ring stage, as each producer's turns_meet, so the per-thread counts agree
            if constexpr (RACECHECK_ORDER)
                for (int q = 1; q < CHUNK / STAGE_KT; q++) consumers_sync();
            ws_trace(10);
            const int next = c0 + CHUNK < kt1 ? c0 + CHUNK : next_kt;
            if (next >= 0) stager.stage(next, buf ^ 1);
            if (X_TMA) stager.wait(chunk, x_full);    // the chunk landed
#pragma unroll
            for (int q = 0; q < CHUNK / STAGE_KT; q++) {
                ws_trace(11);
                mbar_wait(full + st, phase);
                ws_trace(12);
                if (has_rows) {
                    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
                    const u32 w_stage = desc_w + st * (STAGE_U32 * 4 >> 4);
                    // Each accumulator's k-tiles back to back (columns 0..63, then 64..127, column octets 8..15).
#pragma unroll
                    for (int half = 0; half < 128 / WGMMA_N; half++)
#pragma unroll
                        for (int t = 0; t < STAGE_KT; t++) {
                            const u32 s = STAGE_KT * q + t;   // k-tile within the chunk
                            const u32 a = x_chunk + (((s >> 2) * WS_ROWS * 128 + (s & 3) * 32) >> 4);
                            const u32 b = w_stage + t * (KTILE_U32 * 4 >> 4) + half * (8 * 256 >> 4);
                            if constexpr (WGMMA_N == 128) wgmma_64x128(&acc[0][0][0][0], a, b);
                            else wgmma_64x64(&acc[0][4 * half][0][0], a, b);
                        }
                    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
                    ws_trace(14);
                    wgmma_wait<1>();   // the previous stage's wgmmas are done with it
                }
                ws_trace(13);
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
    }
};

// Each of the consumer thread's two rows (g and g + 8 of its warp) replaced by its unnormalised 128-point Hadamard,
// with the roundings of hadamard128_warp (on 0 + acc, as after add_splits, when plus_zero): butterflies over column
// bits 0..6 in that order, where column 16 nt + 8 h + 2 (lane % 4) + e % 2 holds acc[0][nt][h][e], so bits 1 and 2
// are across lanes.
template <bool plus_zero = true>
__device__ __forceinline__ void hadamard_rows(WsAcc& acc) {
    auto& v = acc[0];
    const int lane = threadIdx.x & 31;
    auto butterfly = [](float& lo, float& hi) {
        const float a = lo, b = hi;
        lo = a + b;
        hi = a - b;
    };
#pragma unroll
    for (int nt = 0; nt < 8; nt++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
#pragma unroll
            for (int e = 0; e < 4; e++)
                if (plus_zero) v[nt][h][e] = 0.f + v[nt][h][e];
            butterfly(v[nt][h][0], v[nt][h][1]);
            butterfly(v[nt][h][2], v[nt][h][3]);
        }
#pragma unroll
    for (int m = 1; m <= 2; m <<= 1) {
        const float sign = lane & m ? -1.f : 1.f;
#pragma unroll
        for (int nt = 0; nt < 8; nt++)
#pragma unroll
            for (int h = 0; h < 2; h++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const float other = __shfl_xor_sync(0xffffffffu, v[nt][h][e], m);
                    v[nt][h][e] = __fmaf_rn(v[nt][h][e], sign, other);
                }
    }
#pragma unroll
    for (int nt = 0; nt < 8; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) butterfly(v[nt][0][e], v[nt][1][e]);
#pragma unroll
    for (int m = 1; m < 8; m <<= 1)
#pragma unroll
        for (int nt = 0; nt < 8; nt++)
            if (!(nt & m))
#pragma unroll
                for (int h = 0; h < 2; h++)
#pragma unroll
                    for (int e = 0; e < 4; e++) butterfly(v[nt][h][e], v[nt | m][h][e]);
}

// f(nt, h, e, k) for each of a consumer thread's accumulators acc[0][nt][h][e], k = 4 (2 nt + h) + e.
template <class F>
__device__ __forceinline__ void each_element(F&& f) {
#pragma unroll
    for (int nt = 0; nt < 8; nt++)
#pragma unroll
        for (int h = 0; h < 2; h++)
#pragma unroll
            for (int e = 0; e < 4; e++) f(nt, h, e, (nt * 2 + h) * 4 + e);
}

// Shared memory of a warp-specialized block: the ring, two x chunk buffers (1024-byte aligned), the ring's
// full / empty barriers and (X_TMA) the x buffers', then `extra` bytes for the caller; the barriers are initialised
// (call before any role).
struct WsShared {
    u32* ring;
    unsigned short* xs;
    u64 *full, *empty, *x_full;   // x_full: the x buffers' barriers (X_TMA)
    unsigned char* extra;

    __device__ WsShared(unsigned char* smem) {
        ring = reinterpret_cast<u32*>(smem);
        unsigned char* xs_at = smem + STAGES * STAGE_U32 * 4;
        xs_at += (1024 - (smem_addr(xs_at) & 1023)) & 1023;   // swizzle atoms start 1024-byte aligned
        xs = reinterpret_cast<unsigned short*>(xs_at);
        full = reinterpret_cast<u64*>(xs_at + 2 * XS_BYTES);
        empty = full + STAGES;
        x_full = empty + STAGES;
        extra = reinterpret_cast<unsigned char*>(x_full + (X_TMA ? 2 : 0));
        if (threadIdx.x == 0) {
            for (int s = 0; s < STAGES; s++) {
                mbar_init(full + s, TURN_WARPS);
                mbar_init(empty + s, CONSUMERS);
            }
            for (int b = 0; b < (X_TMA ? 2 : 0); b++) mbar_init(x_full + b, 1);
            if (X_TMA) asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");   // seen by TMA
        }
        __syncthreads();
    }
};
