"""Result rows of `exl3moe demo` and `exl3moe verify`: printed one by one as each check completes (so a later error
loses nothing), in fixed columns that fit the console (100 columns when not a terminal), beside a progress bar."""

from __future__ import annotations

import sys

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .backends import CUDA, INTERPRETER, TORCH, TRITON

LIMIT = 2e-3   # relative L2 error against float64 that a row must stay below
DEFAULT_WIDTH = 100
SHORT_BACKEND = {CUDA: "CUDA C++", TRITON: "Triton", INTERPRETER: "interp.", TORCH: "torch"}
COLUMNS = (("module", None, "left"), ("shape", 12, "left"), ("K/codebook", 11, "left"), ("kernels", 8, "left"),
           ("rel. L2", 8, "right"), ("check", 5, "left"), ("ms", 6, "right"))


def report_console(width: int | None = None) -> Console:
    """stdout at `width` columns (default: the terminal's, DEFAULT_WIDTH when not a terminal)."""
    if width is None and not sys.stdout.isatty():
        width = DEFAULT_WIDTH
    return Console(width=width, highlight=False)


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def progress_bar(console: Console) -> Progress:
    """A transient bar on the report's console (off when it is not a terminal)."""
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, transient=True, disable=not console.is_terminal)


class RowPrinter:
    """Prints the header once and then each row as it comes, in the same column widths."""

    def __init__(self, console: Console):
        self.console = console
        fixed = sum(width for _, width, _ in COLUMNS if width) + len(COLUMNS) - 1
        self.widths = [width or max(16, console.width - fixed) for _, width, _ in COLUMNS]

    def _line(self, cells: list, style: str | None = None) -> None:
        table = Table(box=None, show_header=False, pad_edge=False, padding=(0, 1, 0, 0), collapse_padding=True)
        for (_, _, justify), width in zip(COLUMNS, self.widths):
            table.add_column(width=width, justify=justify, overflow="fold")
        table.add_row(*cells, style=style)
        self.console.print(table)

    def header(self) -> None:
        self._line([name for name, _, _ in COLUMNS], style="bold")

    def row(self, name: str, shape: str, formats: list, backend: str, error: float, seconds: float) -> bool:
        """One checked row (several formats: their count, and the list on the line below); True when it passes."""
        ok = error < LIMIT
        result = "[green]ok[/green]" if ok else "[red]FAIL[/red]"
        cell = formats[0] if len(formats) == 1 else f"{len(formats)} formats"
        self._line([name, shape, cell, SHORT_BACKEND.get(backend, backend), f"{error:.2e}", result,
                    f"{seconds * 1e3:.0f}"])
        if len(formats) > 1:
            self.console.print(f"  formats: {', '.join(formats)}")
        return ok

    def error(self, name: str, err: Exception) -> None:
        """A row that could not be checked, and why, on the line below."""
        self._line([name, "", "", "", "", "[red]ERROR[/red]", ""])
        self.console.print(f"  {err}", style="red", soft_wrap=False)
