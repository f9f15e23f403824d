"""Whether a call is bound by the board's power limit: each case's CUDA graph (as scripts/ab_defines.py builds it)
replays for a few seconds while nvidia-smi samples the SM clock, the power draw and the clock-limit reasons.
Prints per case the median time, the median and lowest clock, the median power and the share of samples under the
software power cap (reason bit 0x4). Cases take ab_defines.py's options (--note included); --sets runs each under define sets."""

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import ab_defines  # noqa: E402
from exl3moe.timing import capture_graph, replay_times  # noqa: E402

SW_POWER_CAP = 0x4
QUERY = "clocks.sm,power.draw,clocks_throttle_reasons.active"


def sample(stop: threading.Event, samples: list) -> None:
    while not stop.is_set():
        line = subprocess.run(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True).stdout.splitlines()[0]
        clock, power, reasons = (field.strip() for field in line.split(","))
        samples.append((float(clock), float(power), int(reasons, 16)))
        time.sleep(0.05)


def probe(calls, seconds: float) -> tuple:
    """(median us per call, samples) over `seconds` of back-to-back replays of the calls' graph."""
    fns = calls()
    graph = capture_graph(fns)
    stop, samples, times = threading.Event(), [], []
    thread = threading.Thread(target=sample, args=(stop, samples))
    thread.start()
    start = time.time()
    while time.time() - start < seconds:
        times += replay_times(graph, len(fns), 4)
    stop.set()
    thread.join()
    return statistics.median(times), samples


def main(args) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    print("case | set | us | clock MHz (median / min) | power W | power-capped share", flush=True)
    for name, calls in ab_defines.cases(args, gen):
        for define_set in args.sets:
            ab_defines.use_set(define_set)
            us, samples = probe(calls, args.seconds)
            capped = sum(1 for s in samples if s[2] & SW_POWER_CAP) / max(1, len(samples))
            print(f"{name} | {define_set} | {us:.2f} | {statistics.median(s[0] for s in samples):.0f} / "
                  f"{min(s[0] for s in samples):.0f} | {statistics.median(s[1] for s in samples):.0f} | {capped:.2f}",
                  flush=True)


if __name__ == "__main__":
    ap = ab_defines.case_arguments(argparse.ArgumentParser())
    ap.add_argument("--seconds", type=float, default=2.5)
    a = ap.parse_args()
    ab_defines.note(a) if a.note else main(a)
