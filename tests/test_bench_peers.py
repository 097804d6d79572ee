"""`bench peers`: the workloads every system gets, and how one point is read from guidellm's report.

The suite itself needs the peers' environments (`bash scripts/peers.sh`) and an hour; these
check what must hold for its comparison to be fair, without running it.
"""

from __future__ import annotations

import json

import pytest

from bench.peer_workloads import WORKLOADS, build, write


@pytest.mark.parametrize("workload", ["chat", "shared_prefix", "burst"])
def test_every_row_is_unique_so_no_cache_answers_a_workload_that_has_no_repeats(workload):
    rows = build(workload, 400, seed=5)
    assert len({json.dumps(r["messages"]) for r in rows}) == len(rows)
    assert build(workload, 400, seed=5) == rows, "the same seed gives every system the same rows"
    assert build(workload, 400, seed=6) != rows


def test_any_stretch_of_the_repeat_stream_is_a_fifth_repeats_in_held_out_words():
    """Every tenth row repeats an earlier one word for word and every tenth rewords one, with the
    evaluation set's held-out pairs (no cache threshold was tuned on them), at any length a
    point's arrivals cut the stream to."""
    from bench.evalset import PARAPHRASES, TEMPLATED_HITS

    held_out = {t for pair in TEMPLATED_HITS for t in pair}
    tuned = {t for pair in PARAPHRASES for t in pair}
    for n in (20, 60, 100):  # a point at 3 requests/s for 20 s has ~60 rows
        texts = [r["messages"][-1]["content"] for r in build("repeats", n, seed=0)]
        exact = len(texts) - len(set(texts))
        reworded = [b for a, b in TEMPLATED_HITS if b in texts and a in texts and texts.index(a) < texts.index(b)]
        assert exact == n // 10, (n, exact)
        assert len(reworded) == n // 10, (n, len(reworded))
        assert not tuned & set(texts)
        assert {t for t in texts if "(ref " not in t} <= held_out


def test_points_of_one_service_life_never_share_a_reworded_pair():
    """The service is restarted per workload, not per point: a pair asked at one rate must not
    be answered from the cache at the next."""
    asked = [{r["messages"][-1]["content"] for r in build("repeats", 100, seed=s, slot=s)} for s in range(4)]
    for i in range(4):
        for j in range(i + 1, 4):
            assert not asked[i] & asked[j], (i, j, asked[i] & asked[j])


def test_a_burst_arrives_in_clumps_at_the_same_mean_rate(tmp_path):
    from bench.peer_workloads import BURST_SIZE, BURST_SPREAD_S, arrivals

    times = arrivals("burst", 7, rate=2.0, seconds=300.0)
    assert 450 <= len(times) <= 750, len(times)
    gaps = sorted(b - a for a, b in zip(times, times[1:]))
    assert gaps[len(gaps) // 2] < BURST_SPREAD_S / 2, "most requests arrive right after another"
    poisson = arrivals("chat", 7, rate=2.0, seconds=300.0)
    assert sum(g < 0.1 for g in gaps) > 2 * sum(b - a < 0.1 for a, b in zip(poisson, poisson[1:]))
    assert BURST_SIZE > 1


def test_shared_prefix_rows_share_one_system_prompt_and_follow_up_up_to_four_turns():
    rows = build("shared_prefix", 200, seed=1)
    assert len({r["messages"][0]["content"] for r in rows}) == 1
    turns = {sum(m["role"] == "user" for m in r["messages"]) for r in rows}
    assert turns == {1, 2, 3, 4}


def test_arrivals_are_a_seeded_poisson_process_inside_the_window(tmp_path):
    path = write("chat", tmp_path, seed=3, rate=2.0, seconds=100.0)
    times = [json.loads(line)["relative_timestamp"] for line in path.read_text().splitlines()]
    assert times == sorted(times) and 0 < times[0] and times[-1] < 100.0
    assert 150 <= len(times) <= 250, len(times)  # 2/s for 100 s
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert len(set(gaps)) > 0.9 * len(gaps), "gaps repeat: not independent draws"
    again = write("chat", tmp_path, seed=3, rate=2.0, seconds=100.0, name="again")
    assert again.read_text() == path.read_text()


def test_a_point_counts_requests_left_running_as_missing_the_objective():
    from bench.peers import summarize

    report = {"benchmarks": [{"duration": 80.0, "metrics": {
        "request_totals": {"successful": 8, "errored": 1, "incomplete": 1},
        "slo_attainment": 6 / 9, "slo_determined_requests": 9,
        "request_goodput": {"successful": {"mean": 0.075}},
        "requests_per_second": {"successful": {"mean": 0.1}},
        "output_tokens_per_second": {"successful": {"mean": 6.4}},
        "time_to_first_token_ms": {"successful": {"median": 300.0, "mean": 350.0, "percentiles": {"p99": 900.0}}},
        "inter_token_latency_ms": {"successful": {"median": 40.0, "mean": 41.0, "percentiles": {"p99": 60.0}}},
        "request_latency": {"successful": {"median": 3.0, "mean": 3.1, "percentiles": {"p99": 4.0}}},
    }}]}
    point = summarize(report)
    assert point["conforming"] == 6 and point["conforming_of_sent"] == 0.6
    assert point["e2e_ms"]["p50"] == 3000.0 and point["ttft_ms"]["p99"] == 900.0
    assert set(WORKLOADS) == {"chat", "shared_prefix", "repeats", "burst"}


def test_the_feature_off_row_runs_the_shipped_graph_without_cache_admission_or_speculation(tmp_path):
    """`bench floor`'s `ours-bare` is serve_config.yaml with only the features off: what the graph
    costs apart from what it adds, against llama-server on the same F32 file."""
    import yaml

    from bench.peer_systems import SYSTEMS
    from configs.schemas import AppArgs

    bare = SYSTEMS["ours-bare"](tmp_path)
    bare.prepare()
    args = yaml.safe_load(bare.config_path.read_text())["applications"][0]["args"]
    parsed = AppArgs.model_validate(args)  # still a valid config
    assert not parsed.cache.enabled and parsed.admission.mode == "fifo"
    assert parsed.target.speculative.method == "none"
    assert bare.model == parsed.target.engine.model_id and parsed.target.engine.weights == "f32"
    from bench.peer_systems import REPO

    shipped = yaml.safe_load((REPO / "serve_config.yaml").read_text())
    assert args["target"]["engine"] == shipped["applications"][0]["args"]["target"]["engine"]


def test_llama_server_rows_serve_the_file_each_of_ours_runs_at_its_precision(tmp_path):
    """Same weights, same precision within a row: llama-server-q4 the shipped Q4_1 file, which
    `ours-q4` pins our small model to (the shipped one runs Q8_0), llama-server the F32 copy our
    target runs."""
    import yaml

    from bench.peer_systems import SYSTEMS, gguf_path
    from configs.schemas import AppArgs
    from configs.serve_config import load_serve_config

    args = load_serve_config().args
    assert SYSTEMS["llama-server-q4"](tmp_path).model_file() == gguf_path()
    q4 = SYSTEMS["ours-q4"](tmp_path)
    q4.prepare()
    small = AppArgs.model_validate(yaml.safe_load(q4.config_path.read_text())["applications"][0]["args"]).draft.engine
    assert small.weights == "gguf" and small.source.gguf_file == gguf_path().name and q4.model == small.model_id
    assert small.model_dump(exclude={"weights", "model_id"}) == args.draft.engine.model_dump(exclude={"weights", "model_id"})
    f32 = SYSTEMS["llama-server"](tmp_path).model_file()
    assert args.target.engine.weights == "f32" and f32.name.endswith(".f32.gguf")
    assert SYSTEMS["ours-f32"].model == args.target.engine.model_id


def test_the_peers_script_defines_each_environment_it_makes_once():
    """`bash scripts/peers.sh` with no argument makes every environment in its default list: each
    is one shell function, defined once (a second definition would silently replace the first)."""
    import re

    from bench.peer_systems import REPO

    text = (REPO / "scripts" / "peers.sh").read_text()
    defined = re.findall(r"^([a-z_]+)\(\) \{", text, flags=re.M)
    default = re.search(r'for what in "\$\{@:-([^}]*)\}"', text).group(1).split()
    assert default and all(defined.count(name) == 1 for name in default), (default, defined)
    assert len(defined) == len(set(defined)), defined


def test_every_system_gets_the_same_trace_and_a_mismatch_fails_the_run(tmp_path):
    from bench.peers import check_same_traces, trace

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = trace("repeats", 1, 3.0, 0, 20.0, tmp_path / "a")
    b = trace("repeats", 1, 3.0, 0, 20.0, tmp_path / "b")
    assert a[1:] == b[1:] and 40 <= a[1] <= 85
    assert trace("repeats", 0, 3.0, 0, 20.0, tmp_path)[2] != a[2], "another point, another trace"

    def start(digest):
        return [{"rep": 0, "points": {3.0: {"trace_sha256": digest}}}]

    assert check_same_traces({"x": {"chat": start(a[2])}, "y": {"chat": start(b[2])}}) == 1
    with pytest.raises(AssertionError):
        check_same_traces({"x": {"chat": start(a[2])}, "y": {"chat": start("0" * 16)}})


def test_goodput_is_a_share_of_the_rate_offered_not_of_a_systems_own_window():
    """A request still running at the end counts as missed; one the load tool never sent does
    not count against the system, and its longer window cannot flatter it."""
    from bench.peers import summarize

    report = {"benchmarks": [{"duration": 80.0, "metrics": {
        "request_totals": {"successful": 16, "errored": 1, "incomplete": 2},
        "slo_attainment": 15 / 17, "slo_determined_requests": 17,
    }}]}
    point = summarize(report, created=20, window_s=10.0)
    assert point["dropped"] == 1 and point["offered_rps"] == 2.0
    assert point["attainment"] == round(15 / 19, 3) and point["goodput_rps"] == round(15 / 19 * 2.0, 3)


def test_each_system_is_compared_within_its_precision_row_and_the_shipped_one_with_every_peer():
    from bench.peer_systems import SYSTEMS
    from bench.peers import comparisons, spread

    rows = {n: SYSTEMS[n].precision for n in ("ours", "ours-bare", "ours-q4", "llama-server", "llama-server-q4", "vllm")}
    assert rows == {"ours": "shipped", "ours-bare": "f32", "ours-q4": "q4_1", "llama-server": "f32",
                    "llama-server-q4": "q4_1", "vllm": "f32"}
    goodput = {"ours": 1.0, "ours-bare": 0.5, "ours-q4": 0.8, "llama-server": 0.6, "llama-server-q4": 0.9, "vllm": 0.7}
    table = {n: {"chat": {"1.0": {"goodput_rps": spread([g])}}} for n, g in goodput.items()}
    got = comparisons(table, rows)
    assert got["ours-bare"] == {"llama-server": {"chat": {"1.0": 0.833}}, "vllm": {"chat": {"1.0": 0.714}}}
    assert got["ours-q4"] == {"llama-server-q4": {"chat": {"1.0": 0.889}}}
    assert set(got["ours"]) == {"llama-server", "llama-server-q4", "vllm"}, "the shipped row meets every peer"
    assert spread([3, 1, 2, None]) == {"median": 2, "min": 1, "max": 3}


def test_a_run_written_elsewhere_keeps_its_reports_beside_it_not_over_the_reference(tmp_path):
    from bench.peers import REPORTS, reports_beside, shown

    assert reports_beside(str(tmp_path / "peers.json")) == tmp_path / "peers"
    assert reports_beside("bench/results/peers.json") == REPORTS
    assert shown(REPORTS / "x.json") == "bench/results/peers/x.json" and shown(tmp_path) == str(tmp_path)


def test_an_update_keeps_the_other_systems_and_refuses_a_different_grid(tmp_path):
    from bench.peers import _kept

    config = {"grid_rps": [1.0, 3.0], "seconds_per_point": 20.0, "drain_s": 20.0, "repetitions": 3,
              "slo": {"ttft_ms": 1000.0, "tpot_ms": 200.0}}
    prev = {"config": {**config, "measured_at": {"llama-server": "2026-11-27"}},
            "systems": {"ours": {"capacity": {"requests_per_s": 0.8}}, "llama-server": {"capacity": {"requests_per_s": 1.2}}},
            "runs": {"ours": {"chat": []}, "llama-server": {"chat": [{"rep": 0}]}},
            "unavailable": {}, "failures": [{"system": "ours", "workload": "chat", "rep": 0, "error": "x"}]}
    path = tmp_path / "peers.json"
    path.write_text(json.dumps(prev))
    kept = _kept(str(path), ["ours"], config)
    assert kept["names"] == ["llama-server"] and list(kept["runs"]) == ["llama-server"]
    assert kept["capacity"] == {"llama-server": {"requests_per_s": 1.2}} and kept["failures"] == []
    assert kept["measured_at"] == {"llama-server": "2026-11-27"}
    prev["config"].pop("measured_at")
    prev["started_unix"] = 1795816865
    path.write_text(json.dumps(prev))
    assert _kept(str(path), ["ours"], config)["measured_at"] == {"llama-server": "2026-11-27"}
    with pytest.raises(SystemExit):
        _kept(str(path), ["ours"], {**config, "grid_rps": [1.0, 2.0]})
    with pytest.raises(SystemExit):  # one workload measured again can't stand beside all four
        _kept(str(path), ["ours"], {**config, "workloads": ["shared_prefix"]})
