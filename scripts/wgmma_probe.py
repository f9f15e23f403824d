"""Does wgmma (A from registers, B from shared memory) give the same bits as mma.sync m16n8k16 for one k16 step?
And which (leading, stride) byte offsets describe the no-swizzle B layout? Prints both answers on an sm_90 GPU;
`--compile-only` builds the kernels for sm_90a here. The answer decides whether a wgmma path for large route
blocks can keep a row's bytes independent of its block (every block size must accumulate identically)."""

import argparse

import torch

from exl3moe.kernels import nvrtc

SOURCE = r"""
typedef unsigned int u32;
typedef unsigned long long u64;

__device__ __forceinline__ u32 pack(const unsigned short* p) { return (u32)p[0] | ((u32)p[1] << 16); }

// A [64, 16] row-major, B [N, 16] (token-major, i.e. K-major B), C0 [64, N]: out_sync / out_wg [64, N] = A B^T + C0.
extern "C" __global__ void __launch_bounds__(128)
probe(const unsigned short* A, const unsigned short* B, const float* C0, float* out_sync, float* out_wg,
      float* out_swap, int lbo, int sbo) {
    __shared__ __align__(128) unsigned short bs[N * 16];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3, r0 = 16 * warp;
    // Core matrices of 8 tokens x 8 k (16-byte rows, 128 bytes each): k halves LBO_LAYOUT apart, token octets SBO.
    for (int i = tid; i < N * 16; i += 128) {
        const int n = i / 16, k = i % 16;
        bs[(n / 8) * 128 + (k / 8) * 64 + (n % 8) * 8 + k % 8] = B[n * 16 + k];
    }
    __syncthreads();
    u32 a[4] = {pack(A + (r0 + g) * 16 + 2 * t), pack(A + (r0 + g + 8) * 16 + 2 * t),
                pack(A + (r0 + g) * 16 + 2 * t + 8), pack(A + (r0 + g + 8) * 16 + 2 * t + 8)};
    for (int j = 0; j < N / 8; j++) {
        float c[4] = {C0[(r0 + g) * N + 8 * j + 2 * t], C0[(r0 + g) * N + 8 * j + 2 * t + 1],
                      C0[(r0 + g + 8) * N + 8 * j + 2 * t], C0[(r0 + g + 8) * N + 8 * j + 2 * t + 1]};
        const u32 b0 = pack(B + (8 * j + g) * 16 + 2 * t), b1 = pack(B + (8 * j + g) * 16 + 2 * t + 8);
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                     "{%0,%1,%2,%3};"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
        out_sync[(r0 + g) * N + 8 * j + 2 * t] = c[0];
        out_sync[(r0 + g) * N + 8 * j + 2 * t + 1] = c[1];
        out_sync[(r0 + g + 8) * N + 8 * j + 2 * t] = c[2];
        out_sync[(r0 + g + 8) * N + 8 * j + 2 * t + 1] = c[3];
    }
    // mma.sync with the roles swapped (tokens as m16, A's rows as n8), as the linear multiplies x by W today.
    for (int i = 0; i < N / 16; i++) {
        for (int j = 2 * warp; j < 2 * warp + 2; j++) {
            const unsigned short* xb = B + (16 * i) * 16;
            u32 xa[4] = {pack(xb + g * 16 + 2 * t), pack(xb + (g + 8) * 16 + 2 * t), pack(xb + g * 16 + 2 * t + 8),
                         pack(xb + (g + 8) * 16 + 2 * t + 8)};
            const u32 w0 = pack(A + (8 * j + g) * 16 + 2 * t), w1 = pack(A + (8 * j + g) * 16 + 2 * t + 8);
            float c[4] = {C0[(8 * j + 2 * t) * N + 16 * i + g], C0[(8 * j + 2 * t + 1) * N + 16 * i + g],
                          C0[(8 * j + 2 * t) * N + 16 * i + g + 8], C0[(8 * j + 2 * t + 1) * N + 16 * i + g + 8]};
            asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                         "{%0,%1,%2,%3};"
                         : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                         : "r"(xa[0]), "r"(xa[1]), "r"(xa[2]), "r"(xa[3]), "r"(w0), "r"(w1));
            out_swap[(8 * j + 2 * t) * N + 16 * i + g] = c[0];
            out_swap[(8 * j + 2 * t + 1) * N + 16 * i + g] = c[1];
            out_swap[(8 * j + 2 * t) * N + 16 * i + g + 8] = c[2];
            out_swap[(8 * j + 2 * t + 1) * N + 16 * i + g + 8] = c[3];
        }
    }
    float d[N / 2];
    for (int j = 0; j < N / 8; j++) {
        d[4 * j] = C0[(r0 + g) * N + 8 * j + 2 * t];
        d[4 * j + 1] = C0[(r0 + g) * N + 8 * j + 2 * t + 1];
        d[4 * j + 2] = C0[(r0 + g + 8) * N + 8 * j + 2 * t];
        d[4 * j + 3] = C0[(r0 + g + 8) * N + 8 * j + 2 * t + 1];
    }
    const u64 addr = (u64)__cvta_generic_to_shared(bs);
    const u64 desc = ((addr >> 4) & 0x3FFF) | ((u64)((lbo >> 4) & 0x3FFF) << 16) | ((u64)((sbo >> 4) & 0x3FFF) << 32);
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
    WGMMA(d, a, desc)
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    for (int j = 0; j < N / 8; j++) {
        out_wg[(r0 + g) * N + 8 * j + 2 * t] = d[4 * j];
        out_wg[(r0 + g) * N + 8 * j + 2 * t + 1] = d[4 * j + 1];
        out_wg[(r0 + g + 8) * N + 8 * j + 2 * t] = d[4 * j + 2];
        out_wg[(r0 + g + 8) * N + 8 * j + 2 * t + 1] = d[4 * j + 3];
    }
}
"""


def wgmma_macro(n: int) -> str:
    """WGMMA(d, a, desc): one m64nNk16 f32 += f16 x f16 with A from registers and a K-major B descriptor."""
    outs = ", ".join(f"%{i}" for i in range(n // 2))
    ins = ", ".join(f"%{n // 2 + i}" for i in range(4))
    desc = n // 2 + 4
    constraints = ", ".join(f'"+f"(D[{i}])' for i in range(n // 2))
    return (f'#define WGMMA(D, A, DESC) asm volatile("wgmma.mma_async.sync.aligned.m64n{n}k16.f32.f16.f16 '
            f'{{{outs}}}, {{{ins}}}, %{desc}, 1, 1, 1, 0;" : {constraints} : "r"(A[0]), "r"(A[1]), "r"(A[2]), '
            f'"r"(A[3]), "l"(DESC));\n')


def build(n: int) -> bytes:
    return nvrtc.compile_cubin(wgmma_macro(n) + SOURCE, {"N": n}, "sm_90a")


def main(args):
    if args.compile_only:
        for n in args.n:
            print(f"N={n}: {len(build(n))} bytes of sm_90a cubin")
        return
    driver, _ = nvrtc._bindings()
    torch.cuda.init()
    g = torch.Generator(device="cuda").manual_seed(0)
    for n in args.n:
        module = nvrtc._check(driver.cuModuleLoadData(build(n)), "cuModuleLoadData")
        func = nvrtc._check(driver.cuModuleGetFunction(module, b"probe"), "cuModuleGetFunction")
        A = torch.randn(64, 16, device="cuda", generator=g).half()
        B = torch.randn(n, 16, device="cuda", generator=g).half()
        C0 = torch.randn(64, n, device="cuda", generator=g) * 4
        ref = A.double() @ B.double().T + C0.double()
        for lbo, sbo in ((128, 256), (256, 128)):
            outs = [torch.full((64, n), float("nan"), device="cuda") for _ in range(3)]
            nvrtc.launch(func, (1, 1, 1), 128, [A.view(torch.int16), B.view(torch.int16), C0, *outs, lbo, sbo])
            torch.cuda.synchronize()
            out_sync, out_wg, out_swap = outs
            bits = lambda a, b: torch.equal(a.view(torch.int32), b.view(torch.int32))  # noqa: E731
            err = [(o.double() - ref).abs().max().item() for o in outs]
            print(f"N={n} lbo={lbo} sbo={sbo}: wgmma == mma.sync {bits(out_wg, out_sync)}, == mma.sync with roles "
                  f"swapped {bits(out_wg, out_swap) if n >= 16 else 'n/a'}; max |err| mma.sync {err[0]:.2e}, "
                  f"wgmma {err[1]:.2e}, swapped {err[2]:.2e}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", nargs="+", type=int, default=[8, 64, 128])
    ap.add_argument("--compile-only", action="store_true")
    main(ap.parse_args())
