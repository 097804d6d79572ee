"""router/prefix_affinity.py without Ray: conversations follow their replica, hot prefixes spread."""

from __future__ import annotations

from router.prefix_affinity import PrefixAffinity, block_hashes

SYSTEM = list(range(100, 164))  # 64 tokens: 4 blocks


def test_block_hashes_chain_only_whole_leading_blocks():
    a = block_hashes(list(range(40)), 16, 256)
    assert len(a) == 2, "40 tokens: two whole blocks, the tail is not cached"
    b = block_hashes([999] + list(range(1, 40)), 16, 256)
    assert a[0] != b[0] and a[1] != b[1], "a block's hash covers every block before it"
    assert block_hashes(list(range(40)) + [7] * 30, 16, 256)[:2] == a


def test_a_conversations_next_turn_goes_where_its_history_is():
    aff = PrefixAffinity(imbalance=2)
    turn1 = SYSTEM + list(range(500, 540))
    loads = {"r1": 0, "r2": 0, "r3": 0}
    aff.record(aff.hashes(turn1), "r2")
    aff.record(aff.hashes(SYSTEM + list(range(900, 950))), "r3")  # another conversation, same system prompt
    turn2 = turn1 + list(range(600, 680))
    ranked, _ = aff.rank(turn2, loads)
    assert ranked[0] == ["r2"], "the longest known prefix wins over the shared system prompt's latest holder"
    assert aff.routed["affinity"] == 1


def test_a_busy_holder_loses_to_load_and_unknown_loads_count_as_idle():
    aff = PrefixAffinity(imbalance=2)
    prompt = SYSTEM + list(range(500, 540))
    aff.record(aff.hashes(prompt), "r1")
    assert aff.rank(prompt, {"r1": 2, "r2": 0})[0][0] == ["r1"], "within the imbalance: stay"
    ranked, _ = aff.rank(prompt, {"r1": 3, "r2": 0})
    assert ranked[0][0] == "r2" and aff.routed["balanced"] == 1, "a hot prefix spreads"
    assert aff.rank(prompt, {"r1": None, "r2": None})[0] == [["r1"], ["r2"]]


def test_new_prompts_spread_and_dead_replicas_are_forgotten():
    aff = PrefixAffinity()
    seen = {aff.rank(list(range(i * 100, i * 100 + 32)), {"r1": 0, "r2": 0})[0][0][0] for i in range(40)}
    assert seen == {"r1", "r2"}, "no holder: power of two choices, both replicas get work"
    prompt = list(range(64))
    aff.record(aff.hashes(prompt), "r1")
    aff.forget("r1")
    assert aff.rank(prompt, {"r2": 0})[0] == [["r2"], []]


def test_memory_is_bounded_least_recently_used_first():
    aff = PrefixAffinity(max_blocks=8)
    old, new = list(range(64)), list(range(1000, 1128))
    aff.record(aff.hashes(old), "r1")
    aff.record(aff.hashes(new), "r2")  # 8 blocks: the old conversation's are evicted
    assert aff.rank(new, {"r1": 0, "r2": 0})[0][0] == ["r2"]
    aff.rank(old, {"r1": 0, "r2": 0})
    assert aff.routed["new"] == 1, "evicted: the old prompt is new again"


def test_a_new_prefix_goes_to_the_same_replica_from_every_ingress():
    """Two ingress replicas learn on their own: a conversation whose turns reach both still
    meets its KV on one model replica, since an unseen prefix goes where its first block hashes."""
    first, second = PrefixAffinity(block_size=4), PrefixAffinity(block_size=4)
    loads = {"r1": 0, "r2": 0, "r3": 0}
    for start in range(20):
        prompt = list(range(start, start + 12))
        (a, *_), _ = first.rank(prompt, loads)
        (b, *_), _ = second.rank(prompt + [99, 98, 97, 96], loads)  # the next turn, on the other ingress
        assert a == b
    homes = {first.rank(list(range(s, s + 12)), loads)[0][0][0] for s in range(20)}
    assert len(homes) > 1, "unseen prefixes spread over the replicas"
    busy = {**loads, a[0]: 10}
    assert first.rank(list(range(19, 31)), busy)[0][0][0] != a[0], "load still wins past the imbalance"
