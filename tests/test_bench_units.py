"""bench/'s own command line."""

from __future__ import annotations

import pytest


def test_bench_engines_flag_is_checked_before_anything_runs(tmp_path, capsys):
    """`--engines` names engines of the engines suite only; a typo or another suite is refused
    at once (usage error), before any model loads or Ray starts."""
    from bench.__main__ import main
    from bench.engines import run

    with pytest.raises(SystemExit, match="transformers and/or vllm"):
        run(engines="tpu")
    with pytest.raises(SystemExit) as exit_info:
        main(["load", "--out", str(tmp_path / "x.json"), "--engines", "vllm"])
    assert exit_info.value.code == 2 and "does not apply to the load suite" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_bench_load_slo_counts_the_interactive_tiers_per_token_target():
    """A FIFO twin that met its deadline and first token but streamed slower than the tier's
    200 ms a token did not meet the SLO admission kept it to: its twin's shed is not false."""
    from bench.load import Outcome

    slow = Outcome("ok", "interactive", 15_000, ttft_ms=400.0, e2e_ms=400.0 + 31 * 250.0, tokens=32)
    paced = Outcome("ok", "interactive", 15_000, ttft_ms=400.0, e2e_ms=400.0 + 31 * 150.0, tokens=32)
    late = Outcome("ok", "interactive", 15_000, ttft_ms=1200.0, e2e_ms=2000.0, tokens=8)
    batch = Outcome("ok", "batch", 30_000, ttft_ms=400.0, e2e_ms=400.0 + 31 * 250.0, tokens=32)
    assert slow.tpot_ms == pytest.approx(250.0) and slow.good and not slow.in_slo
    assert paced.in_slo and batch.in_slo and not late.in_slo


def test_bench_load_capacity_probe_climbs_to_the_knee():
    """The probe doubles its clients while goodput grows, so "1x" is the knee FIFO reaches, not
    a client count below it; it stops past the knee or at the models' seats."""
    from bench.load import _probe_done

    def runs(*points):
        return [{"clients": 2 ** (i + 1), "goodput_rps": g} for i, g in enumerate(points)]

    assert not _probe_done(runs(0.8), seats=24)
    assert not _probe_done(runs(0.93, 0.97), seats=24)  # a flat start is noise, not the knee
    assert not _probe_done(runs(0.8, 1.1, 1.8), seats=24)  # still growing at 8 clients
    assert _probe_done(runs(0.8, 1.1, 1.8, 1.85), seats=24)  # 16 added under 5%
    assert _probe_done(runs(0.8, 1.1, 1.8, 1.5), seats=24)  # fell
    assert _probe_done(runs(0.8, 1.1, 1.8, 2.1, 2.4), seats=24)  # 32 clients: past the seats
