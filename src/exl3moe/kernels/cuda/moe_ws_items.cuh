// moe_mma.cu's warp-specialized work items on trellis_ws.cuh: producer and consumer sides of one item with its
// residual stages, the mainloop of one block, and the persistent kernels' walk over items.
#pragma once
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
// rows [start, start + nrows) of x (pre-rotated) over k-tiles [kt0, kt1) go to store(acc, row0)
// (row0: the warp's first row in the block); produce(words, key, cursor) decodes one trellis into the ring. Both
// roles leave with the block's entry register count.
template <class Produce, class Store>
__device__ __forceinline__ void ws_mainloop(const WsShared& sh, XSource x, int start, int nrows, int kt0, int kt1,
                                            const u32* words, int key, int index, int stride, int num_stages,
                                            const long long* __restrict__ addr,
                                            const int* __restrict__ k2, const int* __restrict__ codebook,
                                            const float* __restrict__ scale, Produce&& produce, Store&& store) {
    ws_roles(
        [&](u32& cursor) {
            ws_produce_item(words, key, index, stride, num_stages, addr, k2, codebook, scale, (kt1 - kt0) / STAGE_KT,
                            cursor, produce);
        },
        [&] {
            WsAcc acc;
            Consumer consumer(x, sh.xs, sh.ring, sh.x_full, start, nrows);
            ws_consume_item(acc, consumer, sh, kt0, kt1, index, stride, num_stages, scale);
            store(acc, consumer_row0());
        });
}

// f(expert, start, nrows, item) for each item of this block that has rows: items blockIdx.x + gridDim.x j of
// `items` (route block x column blocks); a persistent kernel's producers and consumers walk the same ones. The
// unused route blocks are the table's last, so the walk ends at the first.
template <class F>
__device__ __forceinline__ void for_each_item(int items, int cblocks, const int* __restrict__ block_expert,
                                              const int* __restrict__ block_start, const int* __restrict__ offsets,
                                              int num_experts, F&& f) {
    for (int item = blockIdx.x; item < items; item += gridDim.x) {
        int expert, start, nrows;
        if (!route_block(item / cblocks, block_expert, block_start, offsets, 0, num_experts, expert, start, nrows))
            break;
        f(expert, start, nrows, item);
    }
}
#endif
