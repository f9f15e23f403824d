"""exl3moe command line: inspect | verify | demo | warmup | bench | quantize | stages. A usage mistake or input that cannot be read is one
line on stderr and exit code 2; a numerical check over its limit is exit code 1."""

from __future__ import annotations

import argparse
import os
import sys
import textwrap

import torch
from rich.console import Console

from . import __version__
from .checkpoint_report import inspect_checkpoint
from .convert.commands import add_quantize_parser, add_stages_parser
from .errors import ContractError, FormatError
from .format.checkpoint import open_checkpoint
from .hf_commands import add_bench_model_parser, add_generate_parser
from .rows import DEFAULT_WIDTH, LIMIT, report_console
from .warmup import CACHE_DOC

EXIT_CODES = """exit codes:
  0  pass (inspect: the checkpoint is complete and consistent)
  1  a numerical check failed: a row's relative L2 error against float64 is over its limit
  2  a usage mistake, or input that cannot be read: a missing or incomplete checkpoint, a layer
     that could not be checked, a device this machine lacks (one line on stderr)"""
ENVIRONMENT = """environment:
  EXL3MOE_CUDA_KERNELS=0  run the Triton kernels on the GPU instead of the CUDA C++ (NVRTC) ones
  EXL3MOE_CACHE_DIR       where compiled CUDA kernels are kept (default ~/.cache/exl3moe/cubins, or
                          $XDG_CACHE_HOME/exl3moe/cubins; empty: no disk cache)
  TRITON_INTERPRET=1      run the Triton kernels on the CPU (slow; what the CPU tests do)"""
MAX_TOKENS = 4096


class CliError(Exception):
    """A mistake or an impossibility the user can act on: one line, exit code 2."""


class Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one line (and exit code 2)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def wrap(text: str) -> str:
    return textwrap.fill(text, DEFAULT_WIDTH - 2)


def device_arg(text: str) -> torch.device:
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device: use cuda, cuda:N or cpu") from None
    if device.type not in ("cuda", "cpu"):
        raise argparse.ArgumentTypeError(f"{text!r}: exl3moe runs on cuda (an NVIDIA GPU) or cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text!r}: torch sees no CUDA GPU on this machine; use --device cpu")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"{text!r}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    return device


def int_arg(low: int, high: int):
    """An argparse type: an int in [low, high]."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is outside {low}..{high}")
        return value
    return parse


def default_device(device: torch.device | None) -> torch.device:
    return device or torch.device("cuda" if torch.cuda.is_available() else "cpu")


def cmd_inspect(args) -> int:
    reader = open_checkpoint(args.path, strict=False)
    inspect_checkpoint(reader, report_console(args.width))
    if reader.problems:
        first = reader.problems[0]
        raise CliError(f"{len(reader.problems)} problem(s) listed above; the first: {first}")
    return 0


def cmd_verify(args) -> int:
    from .verify import verify_checkpoint
    if (args.tp, args.ep) != (1, 1):
        from .parallel.verify import verify_parallel
        force_cpu = args.device is not None and args.device.type == "cpu"
        return verify_parallel(args.path, args.tp, args.ep, report_console(args.width), force_cpu)
    reader = open_checkpoint(args.path)   # an incomplete checkpoint stops here, before any work
    return verify_checkpoint(reader, default_device(args.device), report_console(args.width)).exit_code


def cmd_demo(args) -> int:
    from .demo import run_demo
    return 0 if run_demo(default_device(args.device), args.tokens, report_console(args.width)) < LIMIT else 1


def cmd_warmup(args) -> int:
    from .backends import describe
    from .kernels import nvrtc
    from .warmup import checkpoint_specs, default_specs, nvrtc_problem, warm
    problem = nvrtc_problem()
    if problem:
        raise CliError(problem)
    if not torch.cuda.is_available():
        raise CliError("torch sees no CUDA GPU: warmup compiles the kernels this machine's GPU runs")
    if nvrtc.cache_dir() is None:
        raise CliError("EXL3MOE_CACHE_DIR is empty (no disk cache), so compiled kernels would not be kept")
    device = default_device(args.device)
    if not nvrtc.available(device):
        raise CliError(f"nothing to compile: {describe(device)}")
    specs = checkpoint_specs(open_checkpoint(args.path)) if args.path else default_specs()
    console = report_console()
    console.print(f"warmup {args.path or '(default layer set)'}: {describe(device)}; cache: {CACHE_DOC}")
    warm(specs, device, console, args.workers)
    return 0


def cmd_bench(args) -> int:
    if not torch.cuda.is_available():
        raise CliError("needs a CUDA GPU (the full benchmarks are bench/linear.py and bench/moe.py)")
    from .backends import describe
    from .timing import quick_linear_bench
    console = Console()
    console.print(f"kernels: {describe(torch.device('cuda'))}")
    quick_linear_bench(console)
    return 0


def add_common(parser: argparse.ArgumentParser, device: bool = True) -> None:
    if device:
        parser.add_argument("--device", type=device_arg, default=None,
                            help="cuda, cuda:N or cpu (default: cuda when torch sees a GPU, else cpu)")
    parser.add_argument("--width", type=int_arg(40, 1000), default=None,
                        help=f"output width in columns (default: the terminal's, {DEFAULT_WIDTH} when not a terminal)")


def build_parser() -> argparse.ArgumentParser:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = Parser(prog="exl3moe", description=wrap("EXL3 linear and MoE layers: check a checkpoint, run it on this "
                                                     "machine's kernels against float64, compile its CUDA kernels "
                                                     "ahead."),
                    epilog=f"{EXIT_CODES}\n\n{ENVIRONMENT}", formatter_class=formatter)
    parser.add_argument("--version", action="version", version=f"exl3moe {__version__}",
                        help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", help="exl3moe COMMAND --help describes each")
    path_help = "checkpoint directory (config.json, quantization_config.json and *.safetensors)"
    inspect = sub.add_parser("inspect", help="describe an EXL3 checkpoint (layers, shapes, K, codebooks, sizes) and "
                             "list what is missing or contradictory", epilog=EXIT_CODES, formatter_class=formatter)
    inspect.add_argument("path", help=path_help)
    add_common(inspect, device=False)
    inspect.set_defaults(func=cmd_inspect)
    verify = sub.add_parser("verify", help="run every quantized linear and MoE layer of a checkpoint through this "
                            "machine's kernels and check each against float64", epilog=EXIT_CODES,
                            formatter_class=formatter,
                            description=wrap("Each quantized linear runs on random fp16 rows and each MoE layer on "
                                             "random fp16 tokens routed by its own router; each row's relative L2 "
                                             "error against float64 evaluation of the same quantized weights must "
                                             f"stay below {LIMIT:g}."))
    verify.add_argument("path", help=path_help)
    add_common(verify)
    for degree, what in (("tp", "tensor-parallel ranks (each holds a slice of every linear and expert)"),
                         ("ep", "expert-parallel ranks (each holds whole experts)")):
        verify.add_argument(f"--{degree}", type=int_arg(1, 64), default=1,
                            help=f"{what}; with --tp or --ep above 1 every layer runs sharded over tp x ep gloo "
                                 "processes and is compared with one process and float64 (default 1)")
    verify.set_defaults(func=cmd_verify)
    demo = sub.add_parser("demo", help="run a mixed-K MoE layer and a linear on this machine, check against float64",
                          epilog=EXIT_CODES, formatter_class=formatter)
    add_common(demo)
    demo.add_argument("--tokens", type=int_arg(1, MAX_TOKENS), default=9,
                      help=f"tokens (rows) per call, 1..{MAX_TOKENS} (default 9)")
    demo.set_defaults(func=cmd_demo)
    warmup = sub.add_parser("warmup", help="compile the CUDA kernels a checkpoint needs (or a default set) into the "
                            "disk cache, in parallel", formatter_class=formatter,
                            epilog=f"{EXIT_CODES}\n\n{wrap('compiled kernels are kept in ' + CACHE_DOC)}",
                            description=wrap(WARMUP_DESCRIPTION))
    warmup.add_argument("path", nargs="?", default=None,
                        help=f"{path_help}; without it, the default set described above")
    warmup.add_argument("--device", type=device_arg, default=None, help="the GPU to compile for (default: cuda)")
    warmup.add_argument("--workers", type=int_arg(1, 1024), default=None,
                        help=f"compiler processes (default: every CPU core, {os.cpu_count()} here)")
    warmup.set_defaults(func=cmd_warmup)
    bench = sub.add_parser("bench", help="quick linear timing on this GPU against fp16 (full: bench/*.py)")
    bench.set_defaults(func=cmd_bench)
    add_generate_parser(sub)
    add_bench_model_parser(sub)
    add_quantize_parser(sub)
    add_stages_parser(sub)
    return parser


WARMUP_DESCRIPTION = ("Plans every layer of the checkpoint (each linear for 1..256 rows, each MoE layer for 1..4096 "
                      "tokens) on this GPU and compiles the CUDA C++ kernel variants those plans use with NVRTC, over "
                      "several processes, so that no first call waits for the compiler. Without PATH: Qwen3-30B-A3B's "
                      "layers and Llama-3-8B's linears at K = 2..6 with the mul1 codebook. Needs cuda-bindings "
                      "(pip install 'exl3moe[cuda]') and a GPU.")


def main(argv=None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:   # --help, --version, a usage error: argparse has printed its line
        return exc.code if isinstance(exc.code, int) else 2
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except (FormatError, ContractError, CliError, OSError) as err:
        print(f"exl3moe {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"exl3moe {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
