"""Summarise an Nsight Compute source-page CSV (per-SASS stall samples): the instructions with the most samples, with
their leading stall reasons, and the totals per reason."""

import csv
import sys


def main(path: str, top: int = 45) -> None:
    with open(path, newline="") as f:
        rows = [r for r in csv.reader(f)]
    start = next(i for i, r in enumerate(rows) if any("Source" == c.strip() for c in r))
    head, body = rows[start], rows[start + 1:]
    col = {name.strip(): i for i, name in enumerate(head)}
    samples = next(c for c in col if c.startswith("Warp Stall Sampling (All"))
    reasons = [c for c in col if c.startswith("stall_") or c.endswith("(All Samples)") and c != samples]

    def num(r, c):
        try:
            return float(r[col[c]].replace(",", ""))
        except (ValueError, IndexError):
            return 0.0

    total = sum(num(r, samples) for r in body) or 1.0
    per_reason = {c: sum(num(r, c) for r in body) for c in reasons}
    print(f"columns: {len(head)}; instructions: {len(body)}; samples: {total:.0f}")
    for c, v in sorted(per_reason.items(), key=lambda kv: -kv[1])[:12]:
        print(f"  {v / total:6.1%}  {c}")
    addr = col.get("Address", 0)
    for r in sorted(body, key=lambda r: -num(r, samples))[:top]:
        lead = sorted(((num(r, c), c) for c in reasons), reverse=True)[:2]
        why = ", ".join(f"{c.replace('stall_', '')} {v / total:.1%}" for v, c in lead if v > 0)
        print(f"{num(r, samples) / total:6.2%}  {r[addr]:>6}  {r[col['Source']].strip()[:70]:70}  {why}")
    executed = next((c for c in col if c.startswith("Instructions Executed")), None)
    if executed:
        by_op = {}
        for r in body:
            op = [w for w in r[col["Source"]].split() if not w.startswith("@")][:1] or ["?"]
            by_op[op[0].split(".")[0]] = by_op.get(op[0].split(".")[0], 0.0) + num(r, executed)
        all_executed = sum(by_op.values()) or 1.0
        print(f"warp instructions executed: {all_executed:.4g}")
        for op, v in sorted(by_op.items(), key=lambda kv: -kv[1])[:16]:
            print(f"  {v / all_executed:6.1%}  {op}")


if __name__ == "__main__":
    main(sys.argv[1])
