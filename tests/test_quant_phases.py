"""The encoder's per-phase time breakdown (quant/phases.py): every phase present, exclusive, summing to the call."""

import time

import pytest
import torch

from exl3moe.quant import quantize_weight
from exl3moe.quant.phases import PHASES, part, phase, timing

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_nested_phases_are_exclusive_and_sum_to_the_whole():
    with timing() as timer:
        with phase("outer"):
            time.sleep(0.02)
            with phase("inner"):
                time.sleep(0.05)
            time.sleep(0.02)
    assert timer.seconds["inner"] == pytest.approx(0.05, abs=0.03)
    assert timer.seconds["outer"] == pytest.approx(0.04, abs=0.03)
    assert set(timer.seconds) == {"other", "outer", "inner"}


def test_a_part_is_inclusive_and_leaves_the_phases_alone():
    with timing() as timer:
        with phase("outer"):
            with part("passes"):
                time.sleep(0.03)
                with phase("inner"):
                    time.sleep(0.03)
    assert timer.parts["passes"] == pytest.approx(0.06, abs=0.03)
    assert timer.seconds["outer"] == pytest.approx(0.03, abs=0.02)
    assert timer.seconds["inner"] == pytest.approx(0.03, abs=0.02)


def test_phase_outside_timing_records_nothing():
    with phase("search_bound"):
        pass
    with timing() as timer:
        pass
    assert set(timer.seconds) == {"other"}


@pytest.mark.parametrize("sync", [False, True])
def test_encoder_reports_every_phase_and_they_sum_to_its_time(sync):
    g = torch.Generator().manual_seed(0)
    W, X = torch.randn(128, 128, generator=g), torch.randn(512, 128, generator=g)
    _, stats = quantize_weight(W, X.T @ X / 512, K=3, scale_tiles=4, sweeps=1, sync_phases=sync)
    assert set(stats.phase_seconds) == set(PHASES)
    assert all(v >= 0 for v in stats.phase_seconds.values())
    total = sum(stats.phase_seconds.values())
    assert total == pytest.approx(stats.seconds, rel=0.02)
    assert stats.phase_seconds["search_bound"] > 0.3 * stats.seconds  # the passes dominate on the CPU
    assert stats.counters["pass_steps"] % 128 == 0 and stats.counters["tile_steps"] > stats.counters["pass_steps"]
    assert stats.counters["traceback_steps"] > 0
    passes, tracebacks = stats.part_seconds["passes"], stats.part_seconds["tracebacks"]
    assert 0 < tracebacks < passes and passes + tracebacks <= 1.01 * stats.seconds
    searched = sum(stats.phase_seconds[p] for p in ("scale_search", "search_bound", "search_seams", "refine"))
    assert passes + tracebacks <= 1.01 * searched
