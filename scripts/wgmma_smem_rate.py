"""What bounds trellis_ws's consumers beside its producers: shared-memory traffic and the decode's integer issue.
One block per SM: two consumer warpgroups walk a 3-stage ring of 4 k-tiles (each stage: 8 m64n64k16 or 4 m64n128k16
per warpgroup and row set, both operands in 128-byte-swizzled shared memory), and P producer warps in two turns wait
on empty, run ALU rounds (24 independent integer instructions each), store bytes into another shared region (the
ring stores and x staging of trellis_ws) and arrive on full. Prints cycles per k-tile of the block (128 per row set
at the tensor peak). Usage: python3 scripts/wgmma_smem_rate.py [--compile-only]"""

import sys

import torch

from exl3moe.kernels import nvrtc
from wgmma_rate import BARRIER_HELPERS, probe_finish

ITERS = 512


def source(n: int, threads: int, sets: int = 1) -> str:
    regs, group = n // 2, 8 * 64 // n
    outs = ", ".join(f"%{i}" for i in range(regs))
    binds = ", ".join(f'"+f"(acc[{i}])' for i in range(regs))
    return BARRIER_HELPERS + f"""
extern "C" __global__ void __launch_bounds__({threads}) wgmma_smem_rate(unsigned long long* cycles, float* sink,
                                                                      int iters, int stage_bytes, int alu) {{
    extern __shared__ __align__(1024) unsigned char operands[];
    __shared__ __align__(8) unsigned long long full[3], empty[3];
    const int producers = blockDim.x / 32 - 8, turn_warps = producers / 2;
    for (int i = threadIdx.x; i < 16640; i += blockDim.x) reinterpret_cast<unsigned*>(operands)[i] = 0x3c003c00u;
    if (threadIdx.x < 3) {{
        init(full + threadIdx.x, turn_warps);
        init(empty + threadIdx.x, 8);
    }}
    __syncthreads();
    if (threadIdx.x >= 256) {{   // producers in two turns: wait empty, store their share, arrive on full
        const int w = (threadIdx.x - 256) / 32, lane = threadIdx.x % 32;
        const int stores = stage_bytes / (128 * turn_warps);
        unsigned* region = reinterpret_cast<unsigned*>(operands + 66560) + (w % turn_warps) * stores * 32 + lane;
        for (int i = w / turn_warps; i < iters; i += 2) {{
            wait_parity(smem(empty + i % 3), ((i / 3) & 1) ^ 1);
            unsigned v[8];
#pragma unroll
            for (int k = 0; k < 8; k++) v[k] = i * 8 + k + lane;
            for (int r = 0; r < alu; r++)
#pragma unroll
                for (int k = 0; k < 8; k++) v[k] = ((v[k] * 0xCBAC1FEDu + r) ^ (v[k] >> 3)) & 0x8FFF8FFFu;
            const unsigned mix = v[0] ^ v[1] ^ v[2] ^ v[3] ^ v[4] ^ v[5] ^ v[6] ^ v[7];
            for (int s = 0; s < stores; s++) region[s * 32] = i + s + mix;
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
            __syncwarp();
            if (lane == 0) arrive(smem(full + i % 3));
        }}
        return;
    }}
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    float acc[{regs}];
#pragma unroll
    for (int i = 0; i < {regs}; i++) {{
        acc[i] = 0.f;
        asm volatile("" : "+f"(acc[i])::"memory");
    }}
    const unsigned base = (smem(operands) + 1023) & ~1023u;
    const unsigned long long a = (unsigned long long)(((base >> 4) & 0x3FFF) | (1u << 16)) |
                                 ((unsigned long long)((1024 >> 4) | (1u << 30)) << 32);
    const unsigned long long b = a + (32768 >> 4);
    const long long start = clock64();
    for (int it = 0; it < iters; it++) {{
        wait_parity(smem(full + it % 3), (it / 3) & 1);
        asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
        for (int j = 0; j < {group}; j++)
#pragma unroll
            for (int r = 0; r < {sets}; r++)   // a second set of 64 rows: A 8 KB further (timing only)
                asm volatile("wgmma.mma_async.sync.aligned.m64n{n}k16.f32.f16.f16 {{{outs}}}, %{regs}, %{regs + 1}, "
                             "1, 1, 1, 0, 0;" : {binds} : "l"(a + 2 * (j & 3) + 512 * r), "l"(b + 2 * (j & 3)));
        asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
        if (it > 0 && threadIdx.x % 32 == 0) arrive(smem(empty + (it - 1) % 3));
    }}
{probe_finish(regs)}}}
"""


# (wgmma n, producer warps, row sets per consumer warpgroup, (bytes stored, ALU rounds) per stage): 128-row blocks
# on 16 producers and on 12 paired ones, and 256-row blocks on 8 paired producers (the same decode per stage, twice
# the x bytes and wgmma), each with the decode's issue load (1792 integer instructions per stage).
CASES = [(64, 16, 1, ((0, 0), (32768, 0), (32768, 9))), (128, 12, 1, ((32768, 0), (32768, 12))),
         (128, 8, 2, ((49152, 0), (49152, 19)))]


def main() -> None:
    compile_only = "--compile-only" in sys.argv
    if compile_only:
        for n, producers, sets, _ in CASES:
            text = source(n, 256 + 32 * producers, sets) + nvrtc.source("trellis_core.cuh")
            nvrtc.cached_cubin(text, {}, "sm_90a")
            print(f"n{n} x {sets} with {producers} producers: compiled")
        return
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    print(f"{torch.cuda.get_device_name(dev)}, {sms} SMs, {ITERS} stages of 4 k-tiles")
    for n, producers, sets, loads in CASES:
        threads = 256 + 32 * producers
        func = nvrtc.kernel("trellis_core.cuh", "wgmma_smem_rate", (), dev.index or 0,
                            prelude=source(n, threads, sets), arch_suffix="a")
        for stage_bytes, alu in loads:
            stage_bytes = stage_bytes // (128 * producers // 2) * (128 * producers // 2)
            cycles = torch.zeros(sms * 2, dtype=torch.int64, device=dev)
            sink = torch.zeros(sms * threads, device=dev)
            for _ in range(2):
                nvrtc.launch(func, (sms, 1, 1), threads, [cycles, sink, ITERS, stage_bytes, alu],
                             shared=66560 + 65536)
            torch.cuda.synchronize()
            per_ktile = (cycles.view(sms, 2).max(dim=1).values.double() / (ITERS * 4)).median().item()
            print(f"m64n{n}k16 x {sets}, {producers} producers, {stage_bytes:6d} bytes stored, {alu:2d} ALU rounds per "
                  f"stage: {per_ktile:6.1f} cycles per k-tile ({128 * sets / per_ktile:.0%} of the tensor peak)")


if __name__ == "__main__":
    main()
