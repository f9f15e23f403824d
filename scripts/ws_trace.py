"""Ring timeline of one trellis_ws block (block 0) from a WS_TRACE build: where producers and consumers wait.
Run: EXL3MOE_NVRTC_DEFINES=WS_TRACE=1[,WS_DIAG=..] python3 scripts/ncu_linear_target.py 128 > trace.txt
Then: python3 scripts/ws_trace.py trace.txt [PRODUCERS]  (cycles of the SM clock; the last launch's events;
PRODUCERS 16 by default, 12 or 8 for paired producers, as the MoE's 128- and 192-row blocks have: a MoE trace comes
from `EXL3MOE_NVRTC_DEFINES=WS_TRACE=1 python3 scripts/moe_probe.py --once --block-m 192 ...`, block 0 of gate/up).
Event codes (trellis_ws.cuh): producers 1 wait empty, 2 got it, 3 arrived on full; consumers 10 x chunk ready,
11 wait full, 12 got it, 14 wgmmas issued and committed, 13 previous group done; 0 / 99 / 100 kernel start / role
done / kernel end."""

import statistics
import sys
from collections import defaultdict



def turn_warps(producers: int) -> int:
    """Producer warps that fill one ring stage together: 8 of one tile column, or 4 paired ones."""
    return 8 if producers == 16 else 4


def load(path: str) -> dict:
    """warp -> [(code, clock)] of the last launch printed."""
    events = defaultdict(dict)
    for line in open(path):
        parts = line.split()
        if len(parts) != 11 or parts[0] != "WS":
            continue
        warp, i, *vals = map(int, parts[1:])
        for j in range(4):
            events[warp][i + j] = (vals[2 * j], vals[2 * j + 1])
    return {w: [e[i] for i in sorted(e) if e[i] != (0, 0)] for w, e in events.items()}


def med(values) -> str:
    values = list(values)
    return f"{statistics.median(values):7.0f}" if values else "      -"


def main(path: str, producers: int = 16) -> None:
    tw = turn_warps(producers)
    turns = producers // tw
    ev = load(path)
    t0 = min(c for es in ev.values() for _, c in es)
    rel = {w: [(code, c - t0) for code, c in es] for w, es in ev.items()}
    print(f"block 0: {len(rel)} warps, {max(c for es in rel.values() for _, c in es)} cycles first to last event")
    got_empty, arrived = defaultdict(list), defaultdict(list)
    for w in range(producers):
        seq = [c for code, c in rel.get(w, []) if code in (1, 2, 3)]
        rounds = [seq[j:j + 3] for j in range(0, len(seq) - 2, 3)]
        for j, (_, got, arrive) in enumerate(rounds):
            got_empty[w // tw + turns * j].append(got)
            arrived[w // tw + turns * j].append(arrive)
        if w % tw == 0:
            waits = [g - b for b, g, _ in rounds]
            busy = [b - a for (_, _, a), (b, _, _) in zip(rounds, rounds[1:])]
            print(f"producer warp {w:2d}: {len(rounds)} stages, wait on empty median {med(waits)}, "
                  f"from arrival to the next wait median {med(busy)}")
    consumer = min(w for w in rel if w >= producers)
    segments = defaultdict(list)
    for (a, ta), (b, tb) in zip(rel[consumer], rel[consumer][1:]):
        segments[(a, b)].append(tb - ta)
    print(f"consumer warp {consumer}, between events:")
    for (a, b), v in sorted(segments.items()):
        print(f"  {a:3d} -> {b:3d}: {len(v):4d} times, median {med(v)}, sum {sum(v)}")
    waits, got, done = ([c for code, c in rel[consumer] if code == k] for k in (11, 12, 13))
    print("stage | producers got empty (last) | arrived on full (last) | consumer waits | got full | previous done")
    for s in range(len(got) // 3, min(len(got), len(got) // 3 + 12)):
        cells = (max(got_empty[s]), max(arrived[s]), waits[s], got[s], done[s])
        print(f"{s:5d} | " + " | ".join(f"{c:{w}d}" for c, w in zip(cells, (26, 22, 14, 8, 13))))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 16)
