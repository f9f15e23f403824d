"""Rebuild the cubin cache for the current sources from the variants a GPU run noted (EXL3MOE_CACHE_DIR/variants),
without a GPU: needs NVRTC of the GPU machine's version (cuda-bindings and nvidia-cuda-nvrtc 13.0 here), since
the version is part of each cubin's key. Then carry the cache directory to the GPU machine.
Usage: python3 scripts/warm_cache.py [workers] (default: every CPU core)."""

import os
import sys

from exl3moe.kernels import nvrtc

if __name__ == "__main__":
    workers = int(sys.argv[1]) if len(sys.argv) > 1 else os.cpu_count() or 1
    print(f"NVRTC {nvrtc.nvrtc_version()}, cache {nvrtc.cache_dir()}, {workers} workers", flush=True)
    compiled, cached = nvrtc.rebuild_variants(workers)
    print(f"{compiled} variants compiled, {cached} already cached")
