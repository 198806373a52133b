"""rlhf.seeding: the two forms of a derived seed, bit for bit as the streams were seeded before the
helper existed (fixed-seed numbers are a contract)."""

from rlhf import seeding


def test_offset_and_nested_are_the_historical_formulas():
    for seed in (0, 1, 42, 2**31 - 1):
        for i in (0, 1, 7, 1000):
            assert seeding.offset(seed, i, seeding.SOURCE) == seed + 7919 * i
            assert seeding.offset(seed, i, seeding.RANK) == seed + 1_000_003 * i
            assert seeding.offset(seed, i, seeding.MINIBATCH) == seed + 31 * i
            assert seeding.offset(seed, i, seeding.REFILL) == seed + 104_729 * i
            assert seeding.nested(seed, i, seeding.ROLLOUT) == seed * 7919 + i
            assert seeding.nested(seed, i, seeding.EPOCH) == seed * 1_000_003 + i
        assert seeding.offset(seed, 1, seeding.PTX) == seed + 17
        assert seeding.offset(seed, 1, seeding.HELD_OUT) == seed + 104729


def test_stream_zero_of_an_offset_family_is_the_seed_itself():
    # rank 0 samples with the request's own seed
    assert seeding.offset(5, 0, seeding.RANK) == 5
