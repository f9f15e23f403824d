"""Rebuild the cubin cache for the current sources from the variants a GPU run noted (EXL3MOE_CACHE_DIR/variants),
without a GPU: needs NVRTC of the GPU machine's version (cuda-bindings and nvidia-cuda-nvrtc 13.0 here), since
the version is part of each cubin's key. Then carry the cache directory to the GPU machine."""

from exl3moe.kernels import nvrtc

if __name__ == "__main__":
    print(f"NVRTC {nvrtc.nvrtc_version()}, cache {nvrtc.cache_dir()}", flush=True)
    compiled, cached = nvrtc.rebuild_variants()
    print(f"{compiled} variants compiled, {cached} already cached")
