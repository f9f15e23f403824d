"""Note the MoE kernel variants the MoE GPU tests compile (pretend sm_90), for scripts/warm_cache.py."""
import sys, torch
sys.path.insert(0, "scripts")
import note_variants as nv
from exl3moe import EXL3Weight, ExpertSet, ResidualStage
from exl3moe.ops.moe import moe_plan
nv.pretend_sm90()
def w(k, n, K, cb):
    trellis = torch.zeros(k // 16, n // 16, int(16 * K), dtype=torch.int16)
    return EXL3Weight(trellis, torch.ones(k).half(), torch.ones(n).half(), cb)
def experts(E, H, I, Ks, cbs, act="silu", limit=None):
    mk = lambda k, n: [w(k, n, Ks[e % len(Ks)], cbs[e % len(cbs)]) for e in range(E)]
    return ExpertSet(mk(H, I), mk(H, I), mk(I, H), act, limit=limit)
q = experts(128, 2048, 768, [4, 3, 2, 6, 2.5], ["mcg", "3inst", "mul1", "mcg", "mul1"])
moe_plan(q, 1024, 8, block_m=128)
for T in (1, 2, 3, 4, 8, 64, 300):   # the mixed Qwen3 layer's routed calls
    moe_plan(q, T, 8)
layer = experts(16, 512, 384, [4, 2, 3.5, 8], ["mcg", "3inst", "mul1", "mcg"])
shared = experts(1, 512, 640, [3], ["mul1"])
for T in (1, 7, 40, 200):   # both backends against float64, with a shared expert
    moe_plan(layer, T, 4, shared=shared)
res = lambda ws, K, cb: [w(x.in_features, x.out_features, K, cb) for x in ws]
st = ResidualStage(res(q.gate, 2, "mcg"), res(q.up, 2, "mcg"), res(q.down, 2, "mcg"), torch.zeros(128, 3))
moe_plan(ExpertSet(q.gate, q.up, q.down, "silu", stages=[st]), 300, 8, block_m=128, out_dtype=torch.float16)
b = experts(16, 512, 384, [4, 3, 2.5], ["mcg", "3inst", "mul1"], "gelu", 6.0)
stages = [ResidualStage(res(b.gate, 2, "mcg"), res(b.up, 2, "mcg"), res(b.down, 2, "mcg"), torch.zeros(16, 3)),
          ResidualStage(res(b.gate, 1.5, "mul1"), None, res(b.down, 3, "3inst"), torch.zeros(16, 3))]
moe_plan(ExpertSet(b.gate, b.up, b.down, "gelu", limit=6.0, stages=stages), 70, 4, block_m=128, out_dtype=torch.float16)
many = experts(16, 512, 384, [4, 3, 2.5, 6, 2], ["mcg", "3inst", "mul1", "mcg", "mul1"], "gelu", 6.0)
for T, block_m in ((6, 16), (30, 32)):   # packed kernels of five formats with biases
    moe_plan(many, T, 4, block_m=block_m, out_dtype=torch.float16)
import os
u = experts(16, 512, 384, [4], ["mcg"])
ust = [ResidualStage(res(u.gate, 2, "mcg"), res(u.up, 2, "mcg"), res(u.down, 2, "mcg"), torch.zeros(16, 3)),
       ResidualStage(res(u.gate, 1, "mcg"), None, res(u.down, 1, "mcg"), torch.zeros(16, 3))]
for union in ("1", "0"):   # the union-stage test, both ways
    os.environ["EXL3MOE_MOE_UNION_STAGES"] = union
    for block_m in (16, 32):
        moe_plan(ExpertSet(u.gate, u.up, u.down, "silu", stages=ust), 20, 4, block_m=block_m, out_dtype=torch.float16)
os.environ.pop("EXL3MOE_MOE_UNION_STAGES")
one_shared = experts(1, 512, 256, [4], ["mcg"])
for K in (4, 3, 2):   # one-format direct plans reading their combine ahead
    for top_k, T in ((4, 4), (10, 1)):
        moe_plan(experts(16, 512, 384, [K], ["mcg"]), T, top_k, shared=one_shared)
for inner in ("1", "0"):   # splits inside route blocks against splits outermost
    os.environ["EXL3MOE_MOE_SPLIT_INNER"] = inner
    for T, block_m in ((16, 16), (64, 16), (300, 32), (600, 64)):
        moe_plan(q, T, 8, block_m=block_m)
os.environ.pop("EXL3MOE_MOE_SPLIT_INNER")
moe_plan(q, 16, 8, out_dtype=torch.float16)   # replays of calls whose every id lives elsewhere
moe_plan(q, 1, 8, out_dtype=torch.float16)
moe_plan(q, 1024, 8, shared=experts(1, 2048, 1024, [4], ["mcg"]), slot_capacity=4096)   # chunked, shared
for T, block_m in ((300, 32), (200, 16), (600, 64), (1024, 128)):   # determinism at every block size
    moe_plan(q, T, 8, block_m=block_m)
moe_plan(q, 16, 8, stage_capacity=2, max_stage_bits=3, stage_codebooks=["mcg", "mul1"])   # stage hot swap
from exl3moe.kernels.moe_mma_config import WIDE_BLOCK_M
from exl3moe.ops import moe_planning
limits = moe_planning.DIRECT_MAX_SLOTS, moe_planning.DIRECT_MAX_SLOTS_MIXED
moe_planning.DIRECT_MAX_SLOTS = moe_planning.DIRECT_MAX_SLOTS_MIXED = 64   # direct small calls, raised to 64 slots
moe_plan(q, 8, 8, shared=experts(1, 2048, 768, [4], ["mcg"]))
moe_planning.DIRECT_MAX_SLOTS, moe_planning.DIRECT_MAX_SLOTS_MIXED = limits
moe_plan(q, 300, 8, block_m=128)   # pre-rotated inputs
quarter = ResidualStage(res(q.gate, 2, "mcg"), res(q.up, 2, "mcg"), res(q.down, 2, "mcg"), torch.zeros(128, 3))
moe_planning.uses_ws = lambda block_m, device: block_m == 128 and os.environ.get("EXL3MOE_MOE_WS", "1") != "0"
for ws in ("0", "1"):   # warp-specialized experts against mma.sync
    os.environ["EXL3MOE_MOE_WS"] = ws
    moe_plan(ExpertSet(q.gate, q.up, q.down, "silu", stages=[quarter]), 300, 8, block_m=128)
os.environ.pop("EXL3MOE_MOE_WS")
for T in (1, 16):   # replays with a shared expert
    moe_plan(q, T, 8, shared=experts(1, 2048, 768, [4], ["mcg"]), out_dtype=torch.float16)
odd = experts(16, 1152, 640, [4, 3, 6], ["mcg", "mul1", "3inst"])
for env, values in (("EXL3MOE_MOE_WS_STAGE_KT", ("4", "8")), ("EXL3MOE_MOE_X_TMA", ("0", "1"))):
    for base in (q, odd):   # whole-chunk ring stages against 4-k-tile ones; x by TMA against cp.async
        E = len(base.down)
        st = ResidualStage(res(base.gate, 2, "mcg"), res(base.up, 2, "mcg"), res(base.down, 2, "mcg"),
                           torch.zeros(E, 3))
        for value in values:
            os.environ[env] = value
            moe_plan(ExpertSet(base.gate, base.up, base.down, "silu", stages=[st]), 300, 8, block_m=128,
                     out_dtype=torch.float16)
    os.environ.pop(env)
print("noted")
sb = [ResidualStage(res(u.gate, 2, "mcg"), res(u.up, 2, "mcg"), res(u.down, 2, "mcg"), torch.zeros(16, 3)),
      ResidualStage(None, None, res(u.down, 1, "mcg"), torch.zeros(16, 3))]
rule = moe_planning.stage_blocks
for setting in ("1", "0"):   # stages in blocks of their own (the rule widened below 16 rows) against one accumulator
    os.environ["EXL3MOE_MOE_STAGE_BLOCKS"] = setting
    for T, block_m in ((12, 16), (30, 16), (2, None), (6, None), (40, 32)):
        moe_planning.stage_blocks = rule if block_m == 16 else (lambda plan: bool(plan.stage_formats) and not plan.ws
                                                            and os.environ.get("EXL3MOE_MOE_STAGE_BLOCKS") != "0")
        moe_plan(ExpertSet(u.gate, u.up, u.down, "silu", stages=sb), T, 4, block_m=block_m, out_dtype=torch.float16)
moe_planning.stage_blocks = rule
os.environ.pop("EXL3MOE_MOE_STAGE_BLOCKS")
for T, block_m in ((1, 16), (9, 32), (40, 64)):   # the gelu / clamp / bias stage layer below 128 rows
    moe_plan(ExpertSet(b.gate, b.up, b.down, "gelu", limit=6.0, stages=stages), T, 4, block_m=block_m,
             out_dtype=torch.float16)
moe_planning.uses_ws = lambda block_m, device: block_m in (128, WIDE_BLOCK_M)
os.environ["EXL3MOE_MOE_SPLIT_ROUTE"] = "0"
for tma in ("0", "1"):   # 192-row route blocks against 128-row ones, x by cp.async and by TMA
    os.environ["EXL3MOE_MOE_X_TMA"] = tma
    for base, T in ((q, 2304), (odd, 300)):
        E = len(base.down)
        moe_planning.TARGET_WARPS = 1 if base is odd else 4096   # the 16-expert layer's down in one split
        st = ResidualStage(res(base.gate, 2, "mcg"), res(base.up, 2, "mcg"), res(base.down, 2, "mcg"),
                           torch.zeros(E, 3))
        for wide in ("0", "1"):
            os.environ["EXL3MOE_MOE_WS_192"] = wide
            moe_plan(ExpertSet(base.gate, base.up, base.down, "silu", stages=[st]), T, 8, out_dtype=torch.float16)
os.environ["EXL3MOE_MOE_WS_192"] = "0"
for tma in ("0", "1"):   # split route blocks against 128-row ones, x by cp.async and by TMA
    os.environ["EXL3MOE_MOE_X_TMA"] = tma
    for base, T in ((q, 2048), (q, 4096), (odd, 300)):
        E = len(base.down)
        moe_planning.TARGET_WARPS = 1 if base is odd else 4096
        st = ResidualStage(res(base.gate, 2, "mcg"), res(base.up, 2, "mcg"), res(base.down, 2, "mcg"),
                           torch.zeros(E, 3))
        for split in ("0", "1"):
            os.environ["EXL3MOE_MOE_SPLIT_ROUTE"] = split
            moe_plan(ExpertSet(base.gate, base.up, base.down, "silu", stages=[st]), T, 8, out_dtype=torch.float16)
os.environ.pop("EXL3MOE_MOE_X_TMA")
os.environ.pop("EXL3MOE_MOE_WS_192")
os.environ.pop("EXL3MOE_MOE_SPLIT_ROUTE")
moe_planning.TARGET_WARPS = 4096
moe_plan(q, 4096, 8, out_dtype=torch.float16)   # split route blocks under replay
sys.path.insert(0, "tests")
from test_moe_coverage import INTEGER_WIDTHS, INTEGER_WIDTH_CODEBOOKS, projection_experts
per_projection = projection_experts(lambda k, n, K, cb, name: w(k, n, K, cb), 128, 2048, 768)
for T in (1, 16, 300):   # gate, up and down of one expert in their own formats
    moe_plan(per_projection, T, 8)
widths = experts(128, 2048, 768, INTEGER_WIDTHS, INTEGER_WIDTH_CODEBOOKS)
for T in (1, 4, 64, 300):   # every integer width in one layer
    moe_plan(widths, T, 8)
for T, capacity, block_m in ((600, 2048, None), (600, 2048, 128), (2048, None, None)):   # every token on one expert
    chunked = moe_plan(q, T, 8, slot_capacity=capacity, block_m=block_m, out_dtype=torch.float16)
    if chunked.chunk_tokens < T:
        moe_plan(q, T, 8, block_m=chunked.block_m)
k4 = experts(128, 2048, 768, [4], ["mcg"])
for T in (1, 2, 1024):   # stage swaps under one captured graph: direct and warp-specialized plans (test_stages_gpu)
    moe_plan(k4, T, 8, out_dtype=torch.float16, stage_capacity=2, max_stage_bits=2)
moe_plan(q, 16, 8, out_dtype=torch.float16, stage_capacity=2, max_stage_bits=3, stage_codebooks=["mcg", "mul1"])
