"""Property tests of the block manager: no leak, no double free, right ref counts."""

from hypothesis import given, settings
from hypothesis import strategies as st

from edgellm.engine.block_manager import BlockManager
from edgellm.engine.sequence import Sequence
from edgellm.sampling.params import SamplingParams

BS = 4
OPS = st.lists(
    st.tuples(
        st.sampled_from(["new", "shared", "append", "fork", "free", "compute", "trim"]),
        st.integers(0, 40),
        st.integers(0, 10),
    ),
    min_size=1,
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(OPS, st.booleans())
def test_random_operations_keep_invariants(ops, caching):
    bm = BlockManager(num_blocks=24, block_size=BS, enable_prefix_caching=caching)
    live: list[Sequence] = []
    shared_prefix = list(range(100, 112))
    for op, a, b in ops:
        if op in ("new", "shared"):
            toks = (shared_prefix if op == "shared" else []) + [a + 1] * (b + 1)
            seq = Sequence("r", toks, SamplingParams())
            if bm.can_allocate(seq):
                bm.allocate(seq)
                assert seq.num_cached_tokens % BS == 0 and seq.num_cached_tokens < len(seq)
                live.append(seq)
        elif live:
            seq = live[a % len(live)]
            if op == "append":
                seq.token_ids += [b] * (a % 5 + 1)
                if bm.can_append(seq):
                    bm.append_slots(seq)
                    assert len(seq.block_table) >= bm.blocks_needed(len(seq))
                else:
                    del seq.token_ids[len(seq.token_ids) - (a % 5 + 1) :]
            elif op == "fork":
                child = Sequence("r", list(seq.token_ids), SamplingParams(), seq.num_prompt_tokens)
                bm.fork(seq, child)
                live.append(child)
            elif op == "free":
                bm.free(seq)
                live.remove(seq)
            elif op == "compute":  # the backend wrote K/V for every token it has a slot for
                if bm.can_append(seq):
                    copies = bm.append_slots(seq)
                    for src, dst in copies:
                        assert bm.blocks[src].ref_count >= 1 and bm.blocks[dst].ref_count == 1
                    seq.num_computed_tokens = len(seq)
                    bm.register_computed(seq)
            elif op == "trim":
                keep = max(seq.num_hashed_blocks * BS, min(len(seq), b))
                bm.trim(seq, keep)
                del seq.token_ids[keep:]
        bm.check_invariants(live)
    for seq in live:
        bm.free(seq)
    bm.check_invariants([])
    assert bm.num_free == bm.num_blocks


def test_prefix_hit_verifies_tokens_and_evicts_lru():
    bm = BlockManager(num_blocks=6, block_size=BS)
    a = Sequence("a", list(range(9)), SamplingParams())
    bm.allocate(a)
    a.num_computed_tokens = 9
    bm.register_computed(a)
    a_blocks = list(a.block_table)
    bm.free(a)
    b = Sequence("b", list(range(9)) + [42], SamplingParams())
    bm.allocate(b)
    assert b.num_cached_tokens == 8 and b.block_table[:2] == a_blocks[:2]
    bm.free(b)
    # filling the pool with other sequences evicts the cached blocks
    others = [Sequence("o", [200 + i] * 8, SamplingParams()) for i in range(3)]
    for o in others:
        bm.allocate(o)
    c = Sequence("c", list(range(9)), SamplingParams())
    assert bm._cached_prefix(c) == []
    for o in others:
        bm.free(o)
    bm.check_invariants([])


def test_copy_on_write_after_fork():
    bm = BlockManager(num_blocks=8, block_size=BS)
    p = Sequence("p", [1, 2, 3, 4, 5, 6], SamplingParams())
    bm.allocate(p)
    p.num_computed_tokens = 6
    child = Sequence("c", list(p.token_ids), SamplingParams())
    bm.fork(p, child)
    p.token_ids.append(7)
    copies = bm.append_slots(p)
    assert copies == [(child.block_table[1], p.block_table[1])]
    assert p.block_table[0] == child.block_table[0]
    bm.check_invariants([p, child])
