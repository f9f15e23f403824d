"""`exl3moe quantize` and `exl3moe stages`: parsers and entry points that cli.py registers."""

from __future__ import annotations

import argparse

FAST_ENCODING = {"exact": False, "scale_tiles": 4}   # quantize --fast: the encoder options it passes


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    return int(value) if value == int(value) else value


def _device(text):
    from ..cli import device_arg

    return device_arg(text)


def add_quantize_parser(sub) -> None:
    p = sub.add_parser("quantize", help="convert a Hugging Face bf16/fp16 checkpoint into an EXL3 checkpoint, layer "
                       "by layer (resumable); docs/convert.md")
    p.add_argument("in_dir", metavar="IN_DIR", help="Hugging Face checkpoint (config.json, *.safetensors, tokenizer)")
    p.add_argument("out_dir", metavar="OUT_DIR", help="output folder (an unfinished conversion there is resumed)")
    p.add_argument("--bits", type=_number, required=True, help="K of every linear (1..8; 1.5/2.5/3.5 with mul1)")
    p.add_argument("--head-bits", type=_number, default=6, help="K of lm_head (default 6)")
    p.add_argument("--codebook", choices=("mcg", "mul1", "3inst"), default="mcg", help="default mcg")
    p.add_argument("--calibration", default="random", help="a text file (tokenized with the checkpoint's tokenizer) "
                   "or 'random' (seeded random tokens; default)")
    p.add_argument("--rows", type=int, default=2048, help="calibration tokens (default 2048)")
    p.add_argument("--expert-bits", type=_number, default=None,
                   help="average K of the routed experts, chosen per expert and projection from calibration")
    p.add_argument("--device", type=_device, default=None, help="cuda, cuda:N or cpu (default: cuda when present)")
    p.add_argument("--force", action="store_true", help="overwrite a non-empty OUT_DIR")
    p.add_argument("--fast", action="store_true", help="a quicker encoding (no exact tail-biting search, coarser scale "
                   "search): a little more error; docs/quant.md")
    p.set_defaults(func=quantize_main)


def quantize_main(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from .quantize import quantize_model

    console = Console()
    fast = FAST_ENCODING if args.fast else {}
    report = quantize_model(args.in_dir, args.out_dir, args.bits, args.head_bits, args.codebook, args.calibration,
                            args.rows, args.expert_bits, args.device, args.force, log=console.print, **fast)
    table = Table(title=f"exl3moe quantize -> {args.out_dir}")
    for column in ("unit", "K", "proxy error", "seconds", "regularised experts", ""):
        table.add_column(column)
    for i, row in enumerate(report.rows):
        error = "-" if row["proxy_error"] is None else f"{row['proxy_error']:.4g}"
        table.add_row(row["unit"], "-" if row["K"] is None else f"{row['K']:g}", error, f"{row['seconds']:.1f}",
                      str(row["regularised_experts"]), "resumed" if i in report.resumed else "")
    console.print(table)
    return 0


def add_stages_parser(sub) -> None:
    p = sub.add_parser("stages", help="residual stages of a target model's experts on an EXL3 base (a stage file for "
                       "MoEPlan.load_stages); docs/convert.md")
    p.add_argument("base_dir", metavar="BASE_DIR", help="EXL3 checkpoint of the base model")
    p.add_argument("target_dir", metavar="TARGET_DIR", help="Hugging Face checkpoint of the target (same shapes)")
    p.add_argument("out", metavar="OUT", help="stage file to write (safetensors)")
    p.add_argument("--stage-bits", type=_number, default=2, help="K of each residual (default 2)")
    p.add_argument("--stages", type=int, default=1, help="stages (default 1)")
    p.add_argument("--device", type=_device, default=None, help="cuda, cuda:N or cpu (default: cuda when present)")
    p.add_argument("--force", action="store_true", help="overwrite OUT")
    p.set_defaults(func=stages_main)


def stages_main(args) -> int:
    from rich.console import Console

    from .stages import make_stages

    errors = make_stages(args.base_dir, args.target_dir, args.out, args.stage_bits, args.stages,
                         device=args.device, force=args.force)
    console = Console()
    for prefix, history in errors.items():
        steps = ", ".join(f"{h:.4g}" for h in history[1:])
        console.print(f"{prefix}: relative weight error {history[0]:.4g} -> {steps} after each stage")
    return 0
