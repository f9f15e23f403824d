"""Note, without a GPU, the kernel variants scripts/ab_arrival.sh times under each define set (argument: the sets,
space-separated, "0" = none), for scripts/warm_cache.py."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
import note_variants  # noqa: E402
from moe import SHAPES  # noqa: E402

from exl3moe.ops.linear import LinearPlan  # noqa: E402
from exl3moe.ops.moe import moe_plan  # noqa: E402

if __name__ == "__main__":
    note_variants.pretend_sm90()
    for define_set in (sys.argv[1] if len(sys.argv) > 1 else "0 ARRIVAL=0 ARRIVAL=1").split():
        os.environ["EXL3MOE_NVRTC_DEFINES"] = "" if define_set == "0" else define_set
        for k, n in ((4096, 14336), (768, 2048), (1408, 4096)):
            for K in (3, 4, 6, 8):
                for codebook in ("mcg", "mul1"):
                    LinearPlan(note_variants.weight(k, n, K, codebook), 8)
        hidden, inter, E, top_k = SHAPES["qwen3-30b-a3b"]
        moe_plan(note_variants.layer(hidden, inter, E, [4]), 1, top_k)
    print("noted")
