"""Tensor-pipe rate of back-to-back wgmma m64n64k16 (f16 in, f32 accumulate, both operands in 128-byte-swizzled
shared memory) on a GPU: one block per SM of 1 or 2 warpgroups, each issuing groups of 8 wgmma (commit, wait<1>).
Modes: 0 nothing else; 1 an mbarrier arrival and wait of each warp between groups; 2 as 1 with 16 more warps asleep on
an mbarrier wait; 3 trellis_ws's ring without data (3 stages, 16 producer warps in two turns waiting on empty and
arriving on full, each group waiting on full and releasing the previous stage); 4 as 3 with trellis_ws's x chunk
start every two groups (wgmma_wait<0>, proxy fence, bar.sync of both warpgroups). Prints cycles per wgmma per SM.
Usage: python3 scripts/wgmma_rate.py"""

import torch

from exl3moe.kernels import nvrtc

GROUP, ITERS, N = 8, 512, 64
REGS = N // 2
OUTS = ", ".join(f"%{i}" for i in range(REGS))
BINDS = ", ".join(f'"+f"(acc[{i}])' for i in range(REGS))

BARRIER_HELPERS = """
__device__ __forceinline__ unsigned smem(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void wait_parity(unsigned bar, unsigned parity) {
    unsigned done = 0;
    while (!done)
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2, 0x989680; "
                     "selp.u32 %0, 1, 0, p; }" : "=r"(done) : "r"(bar), "r"(parity) : "memory");
}
__device__ __forceinline__ void arrive(unsigned bar) {
    asm volatile("{ .reg .b64 st; mbarrier.arrive.shared::cta.b64 st, [%0]; }" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void init(unsigned long long* bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem(bar)), "r"(count) : "memory");
}

"""



def probe_finish(regs: int) -> str:
    """A probe kernel's end: drain the wgmma groups, sum the `regs` accumulators (fenced, so ptxas keeps every
    wgmma), store the sum and each warpgroup's cycles since `start`."""
    return f"""    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < {regs}; i++) {{
        asm volatile("" : "+f"(acc[i])::"memory");
        sum += acc[i];
    }}
    const long long end = clock64();
    sink[blockIdx.x * blockDim.x + threadIdx.x] = sum;
    if (threadIdx.x % 128 == 0) cycles[blockIdx.x * 2 + threadIdx.x / 128] = end - start;
"""


SOURCE = BARRIER_HELPERS + f"""
extern "C" __global__ void __launch_bounds__(768) wgmma_rate(unsigned long long* cycles, float* sink, int iters,
                                                           int mode, int groups) {{
    extern __shared__ __align__(1024) unsigned char operands[];
    __shared__ __align__(8) unsigned long long own[2], sleep, full[3], empty[3];
    for (int i = threadIdx.x; i < 16640; i += blockDim.x) reinterpret_cast<unsigned*>(operands)[i] = 0x3c003c00u;
    if (threadIdx.x < 3) {{
        init(full + threadIdx.x, 8);
        init(empty + threadIdx.x, 8);
        if (threadIdx.x < 2) init(own + threadIdx.x, 4);
        else init(&sleep, 1);
    }}
    __syncthreads();
    if (mode >= 3 && threadIdx.x >= 256) {{   // 16 producer warps in two turns: wait empty, arrive on full
        for (int i = (threadIdx.x - 256) / 256; i < iters; i += 2) {{
            wait_parity(smem(empty + i % 3), ((i / 3) & 1) ^ 1);
            if (threadIdx.x % 32 == 0) arrive(smem(full + i % 3));
        }}
        return;
    }}
    if (threadIdx.x >= 128 * groups) {{   // sleepers, until the consumers finish
        wait_parity(smem(&sleep), 0);
        return;
    }}
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    float acc[{REGS}];
#pragma unroll
    for (int i = 0; i < {REGS}; i++) {{
        acc[i] = 0.f;
        asm volatile("" : "+f"(acc[i])::"memory");   // no reads of the accumulators inside ptxas's wgmma pipeline
    }}
    const unsigned base = (smem(operands) + 1023) & ~1023u;   // swizzle atoms start 1024-byte aligned
    const unsigned long long a = (unsigned long long)(((base >> 4) & 0x3FFF) | (1u << 16)) |
                                 ((unsigned long long)((1024 >> 4) | (1u << 30)) << 32);
    const unsigned long long b = a + (32768 >> 4);
    const long long start = clock64();
    for (int it = 0; it < iters; it++) {{
        if (mode == 4 && it % 2 == 0) {{   // trellis_ws's x chunk start
            asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
            asm volatile("bar.sync 1, 256;" ::: "memory");
        }}
        if (mode >= 3) wait_parity(smem(full + it % 3), (it / 3) & 1);
        asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
        for (int j = 0; j < {GROUP}; j++)
            asm volatile("wgmma.mma_async.sync.aligned.m64n{N}k16.f32.f16.f16 {{{OUTS}}}, %{REGS}, %{REGS + 1}, "
                         "1, 1, 1, 0, 0;" : {BINDS} : "l"(a + 2 * (j & 3)), "l"(b + 2 * (j & 3)));
        asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
        if (mode >= 3 && it > 0 && threadIdx.x % 32 == 0) arrive(smem(empty + (it - 1) % 3));
        if (mode == 1 || mode == 2) {{   // each warp arrives on its warpgroup's barrier and waits for the phase
            const unsigned bar = smem(own + threadIdx.x / 128);
            if (threadIdx.x % 32 == 0) arrive(bar);
            wait_parity(bar, it & 1);
        }}
    }}
{probe_finish(REGS)}    if (threadIdx.x == 0) arrive(smem(&sleep));
}}
"""


def main() -> None:
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    print(f"{torch.cuda.get_device_name(dev)}, {sms} SMs; groups of {GROUP} wgmma, {ITERS} groups per warpgroup")
    # The module needs a file of kernels/cuda to follow the prelude; trellis_core.cuh defines only helpers.
    func = nvrtc.kernel("trellis_core.cuh", "wgmma_rate", (), dev.index or 0, prelude=SOURCE, arch_suffix="a")
    for groups, mode in ((1, 0), (2, 0), (2, 1), (2, 2), (2, 3), (2, 4)):
        cycles = torch.zeros(sms * 2, dtype=torch.int64, device=dev)
        sink = torch.zeros(sms * 768, device=dev)
        threads = 128 * groups + (512 if mode >= 2 else 0)
        for _ in range(2):
            nvrtc.launch(func, (sms, 1, 1), threads, [cycles, sink, ITERS, mode, groups], shared=65536 + 1024)
        torch.cuda.synchronize()
        per_wgmma = (cycles.view(sms, 2)[:, :groups].max(dim=1).values.double() / (ITERS * GROUP * groups)).median()
        flop = 2 * 64 * N * 16 / per_wgmma.item()
        print(f"m64n{N}k16, {groups} warpgroup(s), mode {mode}: {per_wgmma.item():6.1f} cycles per wgmma per SM, "
              f"{flop:6.0f} FLOP/cycle/SM ({flop / 4096:.0%} of the 4096 peak)")


if __name__ == "__main__":
    main()
