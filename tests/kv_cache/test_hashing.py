"""Chained block hashes: a block's hash covers its whole prefix and the cache salt."""

from __future__ import annotations

from shoal.kv_cache.hashing import hash_block, hash_full_blocks

BS = 4


def test_same_tokens_and_salt_give_same_hashes() -> None:
    toks = list(range(10, 30))
    a = hash_full_blocks(toks, BS, [], "tenant")
    b = hash_full_blocks(list(toks), BS, [], "tenant")
    assert a == b
    assert len(a) == 5
    assert len(set(a)) == 5
    assert all(isinstance(x, bytes) and len(x) == 16 for x in a)


def test_only_full_blocks_are_hashed() -> None:
    assert hash_full_blocks(list(range(3)), BS, []) == []
    assert len(hash_full_blocks(list(range(4)), BS, [])) == 1
    assert len(hash_full_blocks(list(range(11)), BS, [])) == 2
    assert hash_full_blocks([], BS, []) == []


def test_hash_is_chained_on_earlier_blocks() -> None:
    a = list(range(16))
    b = list(a)
    b[1] = 999  # differs only in the first block
    ha, hb = hash_full_blocks(a, BS, []), hash_full_blocks(b, BS, [])
    # Identical later blocks still hash differently because their prefix differs.
    assert all(x != y for x, y in zip(ha, hb))


def test_later_difference_keeps_earlier_hashes() -> None:
    a = list(range(16))
    b = list(a)
    b[9] = 999  # third block
    ha, hb = hash_full_blocks(a, BS, []), hash_full_blocks(b, BS, [])
    assert ha[:2] == hb[:2]
    assert ha[2] != hb[2] and ha[3] != hb[3]


def test_block_hash_is_not_position_free() -> None:
    # The same 4 tokens as first block and as second block hash differently.
    toks = [1, 2, 3, 4, 1, 2, 3, 4]
    h = hash_full_blocks(toks, BS, [])
    assert h[0] != h[1]


def test_cache_salt_separates_tenants() -> None:
    toks = list(range(12))
    plain = hash_full_blocks(toks, BS, [])
    s1 = hash_full_blocks(toks, BS, [], "alice")
    s2 = hash_full_blocks(toks, BS, [], "bob")
    for i in range(3):
        assert len({plain[i], s1[i], s2[i]}) == 3
    # No block of one tenant matches any block of another.
    assert not set(s1) & set(s2)
    assert not set(s1) & set(plain)


def test_extend_from_start_matches_full_computation() -> None:
    toks = list(range(100, 124))
    full = hash_full_blocks(toks, BS, [], "s")
    part = hash_full_blocks(toks[:9], BS, [], "s")
    assert part == full[:2]
    assert hash_full_blocks(toks, BS, part, "s") == full
    # Given start hashes are kept as they are (not recomputed).
    fake = [b"x" * 16]
    ext = hash_full_blocks(toks[:8], BS, fake, "s")
    assert ext[0] == b"x" * 16
    assert ext[1] == hash_block(b"x" * 16, toks[4:8], "s")


def test_hash_block_matches_chain() -> None:
    toks = list(range(8))
    h0 = hash_block(None, toks[:4], "salt")
    h1 = hash_block(h0, toks[4:], "salt")
    assert hash_full_blocks(toks, BS, [], "salt") == [h0, h1]


def test_token_values_beyond_int32_distinguished() -> None:
    assert hash_block(None, [2**33, 0, 0, 0]) != hash_block(None, [0, 0, 0, 0])
    assert hash_block(None, [1, 2, 3, 4]) != hash_block(None, [4, 3, 2, 1])
