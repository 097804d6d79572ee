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
