"""Note, without a GPU, the kernel variants scripts/ws_diag.sh times: the warp-specialized linear (4096x14336 and
14336x4096 K4 MCG, 64 and 128 rows) and MoE (Qwen3 K4, 1024 and 4096 tokens) for each WS_DIAG value given (0 is
the real kernel); then scripts/warm_cache.py builds them into EXL3MOE_CACHE_DIR."""

import os
import sys

from exl3moe.ops.linear import LinearPlan
from exl3moe.ops.moe import moe_plan

import note_variants as nv

if __name__ == "__main__":
    nv.pretend_sm90()
    for diag in sys.argv[1:] or ["0"]:
        # A bare number is a WS_DIAG value; "A=1,B=2" is passed as it is (e.g. WS_TRACE=1,WS_DIAG=63).
        os.environ["EXL3MOE_NVRTC_DEFINES"] = diag if "=" in diag else f"WS_DIAG={diag}" if diag != "0" else ""
        for shape in ((4096, 14336), (14336, 4096)):
            for rows in (64, 128):
                LinearPlan(nv.weight(*shape, 4, "mcg"), rows)
        for tokens in (1024, 4096):
            moe_plan(nv.layer(2048, 768, 128, [4]), tokens, 8)
    print("noted WS_DIAG", *(sys.argv[1:] or ["0"]))
