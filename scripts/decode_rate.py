"""Decode rate of trellis_core.cuh's tile decode with nothing else in the way: each warp decodes k-tiles of two n16
columns (as trellis_mma at one row) from words in shared memory and feeds them to mma.sync, so the loop is the
decode's instruction mix alone (no DRAM, no barriers). Prints weights per us per GPU for formats, pair-sum variants
and warps per SM, to compare with the linear's 1-row rate. `--warm` compiles every variant into the cache (no GPU).
Usage: python3 scripts/decode_rate.py [--warm] [--variants K2=8,CB=1,PAIR_SCALAR=2 ...]"""

import sys

import torch

from exl3moe.kernels import nvrtc

TILES_PER_ITER = 8  # k-steps per unrolled loop body, two tiles each
VARIANTS = [dict(K2=8, CB=1, PAIR_SCALAR=0), dict(K2=8, CB=1, PAIR_SCALAR=1), dict(K2=8, CB=1, PAIR_SCALAR=2),
            dict(K2=8, CB=1, PAIR_SCALAR=3), dict(K2=8, CB=1, PAIR_SCALAR=3, USE_MMA=0), dict(K2=8, CB=2),
            dict(K2=8, CB=0, PAIR_SCALAR=3), dict(K2=4, CB=1, PAIR_SCALAR=3), dict(K2=12, CB=1, PAIR_SCALAR=3)]
BLOCKS_PER_SM = (1, 2, 4, 8)

KERNEL = r"""
#ifndef USE_MMA
#define USE_MMA 1
#endif
extern "C" __global__ void __launch_bounds__(128) decode_rate(float* sink, int iters) {
    using T = Trellis<K2, CB>;
    __shared__ u32 table[1024];
    for (int i = threadIdx.x; i < 1024; i += 128) table[i] = (i * 2654435761u) ^ (blockIdx.x * 40503u);
    __syncthreads();
    const int lane = threadIdx.x & 31;
    const u32 a[4] = {0x3c003c00u ^ lane, 0x3c00u, 0x3c000000u, 0x3c003c00u};
    float acc[2][2][4] = {};
    u32 sink_bits = 0;
    const u32 sh = (lane * 3) & 31;
    int base = lane * 7 + threadIdx.x / 32 * 131;
    for (int it = 0; it < iters; it++) {
#pragma unroll
        for (int t = 0; t < TILES; t++) {
            u32 b[2][4];
#pragma unroll
            for (int nt = 0; nt < 2; nt++) {
                u32 w[T::NW];
#pragma unroll
                for (int i = 0; i < T::NW; i++) w[i] = table[(base + (t * 2 + nt) * T::NW + i) & 1023];
                T::decode_tile(w, sh, b[nt]);
#if USE_MMA
                mma16816(acc[nt][0], a, b[nt][0], b[nt][1]);
                mma16816(acc[nt][1], a, b[nt][2], b[nt][3]);
#else
                sink_bits ^= b[nt][0] ^ b[nt][1] ^ b[nt][2] ^ b[nt][3];
#endif
            }
        }
        base += 2 * TILES * T::NW + 1;
    }
    float s = __uint_as_float(sink_bits & 0x3fffffffu);
#pragma unroll
    for (int nt = 0; nt < 2; nt++)
#pragma unroll
        for (int h = 0; h < 2; h++)
#pragma unroll
            for (int e = 0; e < 4; e++) s += acc[nt][h][e];
    sink[blockIdx.x * 128 + threadIdx.x] = s;
}
"""


def defines_of(variant: dict) -> dict:
    return {"TILES": TILES_PER_ITER, **{k: str(v) for k, v in variant.items()}}


def text() -> str:
    return nvrtc.source("trellis_core.cuh") + KERNEL


def load(variant: dict, device_index: int):
    driver, _ = nvrtc._bindings()
    torch.cuda.synchronize(device_index)   # the driver calls below need torch's context
    major, minor = torch.cuda.get_device_capability(device_index)
    cubin = nvrtc.cached_cubin(text(), defines_of(variant), f"sm_{major}{minor}")
    module = nvrtc._check(driver.cuModuleLoadData(cubin), "cuModuleLoadData")
    return nvrtc._check(driver.cuModuleGetFunction(module, b"decode_rate"), "cuModuleGetFunction")


def variants() -> list:
    """VARIANTS, or those given after --variants as NAME=VALUE,... items."""
    if "--variants" not in sys.argv:
        return VARIANTS
    given = sys.argv[sys.argv.index("--variants") + 1:]
    return [dict(item.split("=", 1) for item in v.split(",")) for v in given if not v.startswith("--")]


def main() -> None:
    if "--warm" in sys.argv:
        for variant in variants():
            nvrtc.cached_cubin(text(), defines_of(variant), "sm_90")
        print(f"{len(variants())} variants in {nvrtc.cache_dir()}")
        return
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    print(f"{torch.cuda.get_device_name(dev)}, {sms} SMs; M weights per us per GPU")
    print("variant".ljust(44) + "".join(f"{4 * b:>8} w/SM" for b in BLOCKS_PER_SM))
    iters = 256
    for variant in variants():
        func = load(variant, dev.index or 0)
        rates = []
        for bps in BLOCKS_PER_SM:
            blocks = sms * bps
            sink = torch.empty(blocks * 128, device=dev)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            nvrtc.launch(func, (blocks, 1, 1), 128, [sink, iters])
            start.record()
            for _ in range(5):
                nvrtc.launch(func, (blocks, 1, 1), 128, [sink, iters])
            end.record()
            end.synchronize()
            us = start.elapsed_time(end) * 1000 / 5
            weights = blocks * 4 * iters * TILES_PER_ITER * 2 * 256
            rates.append(weights / us / 1e6)
        name = " ".join(f"{k}={v}" for k, v in variant.items())
        print(name.ljust(44) + "".join(f"{r:13.2f}" for r in rates))


if __name__ == "__main__":
    main()
