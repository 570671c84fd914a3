"""The data-parallel router's policies and its approximate prefix trees (no engines)."""

from __future__ import annotations

from banyan.distributed.router import BALANCE_ABS, PrefixTree, Router

PAGE = 4
SYSTEM_A = list(range(100, 132))  # 8 pages
SYSTEM_B = list(range(200, 232))


def router(policy: str = "cache_aware", replicas: int = 2, capacity: int = 64) -> Router:
    return Router(policy, replicas, PAGE, capacity)


def test_round_robin_and_least_load_skip_dead_replicas():
    r = router("round_robin", 3)
    assert [r.choose(None, [1] * 8, [0, 0, 0], [True, False, True]) for _ in range(4)] == [0, 2, 0, 2]
    assert router("least_load", 3).choose(None, [1], [5, 2, 3], [True, True, True]) == 1


def test_cache_aware_follows_the_longest_prefix_and_spreads_new_ones():
    r = router()
    first = r.choose(None, SYSTEM_A + [1, 2], [0, 0], [True, True])
    second = r.choose(None, SYSTEM_B + [3, 4], [0, 0], [True, True])
    assert first != second  # a new prefix goes where the tree is smallest
    assert r.choose(None, SYSTEM_A + [5, 6, 7], [0, 3], [True, True]) == first
    assert r.choose(None, SYSTEM_B + [8], [3, 0], [True, True]) == second
    assert r.stats.matched_tokens == 2 * 32 and r.stats.per_replica == [2, 2]


def test_namespaces_never_match_each_other():
    r = router()
    home = r.choose("tenant-1", SYSTEM_A, [0, 0], [True, True])
    assert r.trees[home].match("tenant-1", SYSTEM_A) == 32
    assert r.trees[home].match("tenant-2", SYSTEM_A) == 0


def test_unbalanced_load_goes_to_the_least_loaded():
    r = router()
    home = r.choose(None, SYSTEM_A, [0, 0], [True, True])
    loads = [0, 0]
    loads[home] = BALANCE_ABS + 5
    assert r.choose(None, SYSTEM_A, loads, [True, True]) == 1 - home


def test_reported_evictions_leave_the_tree_least_recent_first():
    r = router()
    r.choose(None, SYSTEM_A, [0, 0], [True, True])  # replica 0
    r.choose(None, SYSTEM_B, [0, 1], [True, False])  # replica 0 too (the other is down), routed later
    tree = r.trees[0]
    assert tree.num_pages == 16
    r.observe_evictions(0, 8)  # the engine evicted 8 pages: the router drops A's, routed longest ago
    assert tree.num_pages == 8 and tree.match(None, SYSTEM_A) == 0 and tree.match(None, SYSTEM_B) == 32
    r.observe_evictions(0, 8)  # the same counter again: nothing new
    assert tree.num_pages == 8


def test_a_tree_never_holds_more_than_the_replica_caches():
    tree = PrefixTree(PAGE, capacity_pages=10)
    tree.insert(None, SYSTEM_A)
    tree.insert(None, SYSTEM_B)
    assert tree.num_pages == 10 and tree.match(None, SYSTEM_B) == 32 and tree.match(None, SYSTEM_A) == 8
