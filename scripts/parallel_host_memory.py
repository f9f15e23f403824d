"""Host memory per rank of exl3moe.hf.from_pretrained(tp=, ep=) on one Qwen3-30B-A3B layer at its real dimensions
(random trellis words, written once), over gloo on the CPU: bytes each rank reads and its peak RSS above the
imports (VmHWM, reset before loading). Usage: python scripts/parallel_host_memory.py [CHECKPOINT_DIR] (written there if empty)."""

from __future__ import annotations

import os
import socket
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

QWEN3_30B_A3B_LAYER = dict(
    model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
    num_experts_per_tok=8, norm_topk_prob=True, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
    num_hidden_layers=1, vocab_size=2048, max_position_embeddings=4096)
LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]


def rss_bytes(field: str = "VmRSS") -> int:
    """A /proc/self/status memory figure (VmRSS now, VmHWM the peak since reset_peak) in bytes (Linux)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def worker(rank: int, world: int, port: int, path: str, tp: int, ep: int, out: str) -> None:
    import exl3moe.hf as hf
    from exl3moe.format import safetensors_io

    torch.set_num_threads(1)
    read = [0]
    read_bytes, read_range = safetensors_io.read_bytes, safetensors_io.read_range

    def counted_bytes(entry, handle=None):
        data = read_bytes(entry, handle)
        read[0] += len(data) if handle is None else 0
        return data

    def counted_range(handle, entry, offset, into):
        read[0] += len(into)
        return read_range(handle, entry, offset, into)

    safetensors_io.read_bytes, safetensors_io.read_range = counted_bytes, counted_range
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from exl3moe.hf.loader import meta_model

    meta_model(path, torch.float16)   # transformers' model classes imported before the baseline
    reset_peak()
    base = rss_bytes()
    model = hf.from_pretrained(path, device="cpu", max_batch_tokens=8, tp=tp, ep=ep)
    peak = rss_bytes("VmHWM") - base
    torch.save({"read": read[0], "peak": peak}, os.path.join(out, f"{tp}x{ep}-{rank}.pt"))
    del model
    if world > 1:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    from exl3moe.format.checkpoint import open_checkpoint
    from exl3moe.hf.synthetic import write_synthetic_checkpoint

    path = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="qwen3-30b-a3b-layer-")
    if not os.path.exists(os.path.join(path, "config.json")):
        write_synthetic_checkpoint(path, QWEN3_30B_A3B_LAYER, K=4, codebook="mcg")
    stored = open_checkpoint(path).tensor_bytes
    print(f"checkpoint {path}: {stored / 2**20:.0f} MiB stored (one layer, embeddings, lm_head)")
    print("tp x ep | rank | read MiB | peak RSS above imports MiB")
    out = tempfile.mkdtemp()
    for tp, ep in LAYOUTS:
        world = tp * ep
        mp.spawn(worker, args=(world, free_port(), path, tp, ep, out), nprocs=world, join=True)
        for rank in range(world):
            got = torch.load(os.path.join(out, f"{tp}x{ep}-{rank}.pt"))
            print(f"{tp} x {ep}   | {rank}    | {got['read'] / 2**20:8.1f} | {got['peak'] / 2**20:8.1f}")


if __name__ == "__main__":
    main()
