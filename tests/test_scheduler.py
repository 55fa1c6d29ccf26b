"""Scheduler policy with the real block manager: admission, chunking, preemption, fairness."""

from edgellm.config import EngineConfig
from edgellm.engine.block_manager import BlockManager
from edgellm.engine.scheduler import Scheduler
from edgellm.engine.sequence import Sequence
from edgellm.sampling.params import SamplingParams


def make(num_blocks=16, block_size=4, budget=64, max_seqs=8, lookahead=None) -> Scheduler:
    config = EngineConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget)
    return Scheduler(config, BlockManager(num_blocks, block_size), 1024, lookahead)


def advance(sched: Scheduler, max_new: int = 4) -> list:
    """Run one step without a model: the scheduled tokens become computed, sequences
    whose chunk reached the end get one new token, and finish after `max_new`."""
    out = sched.schedule()
    for item in out.scheduled:
        seq = item.seq
        wants = item.wants_logits
        sched.block_manager.commit(seq, item.start + item.num_new)
        if wants:
            seq.token_ids.append(7)
            if len(seq.output_ids) >= max_new:
                sched.finish(seq, "length")
    sched.block_manager.check_invariants(sched.running)
    return out.scheduled


def seq(n: int, rid: str = "r") -> Sequence:
    return Sequence(rid, list(range(1, n + 1)), SamplingParams())


def test_admits_as_blocks_free_up():
    sched = make(num_blocks=6)
    a, b = seq(16, "a"), seq(16, "b")  # 4 blocks each (+1 for the next token later)
    sched.add(a)
    sched.add(b)
    first = advance(sched)
    assert [s.seq for s in first] == [a] and b in sched.waiting
    while a in sched.running:
        advance(sched)
    assert [s.seq.request_id for s in advance(sched)] == ["b"]


def test_long_prompt_is_chunked_and_interleaved_with_decodes():
    sched = make(num_blocks=64, budget=10)
    short = seq(3, "short")
    sched.add(short)
    advance(sched, max_new=100)  # short is now decoding
    long = seq(35, "long")
    sched.add(long)
    chunks = []
    while long.num_computed_tokens < 35:
        step = {s.seq.request_id: s.num_tokens for s in advance(sched, max_new=100)}
        assert step["short"] == 1  # the decode is never starved by the prefill
        chunks.append(step.get("long", 0))
        assert sum(step.values()) <= 10
    assert sum(chunks) == 35 and max(chunks) == 9


def test_preempts_newest_and_resumes():
    sched = make(num_blocks=5, budget=64)
    old, new = seq(7, "old"), seq(7, "new")  # 2 blocks each, growing
    sched.add(old)
    sched.add(new)
    advance(sched, max_new=12)
    assert len(sched.running) == 2
    preempted = False
    for _ in range(40):
        if not sched.has_work():
            break
        advance(sched, max_new=12)
        preempted |= new in sched.waiting
        assert old in sched.running or old.finished  # the oldest is never the victim
    assert preempted and sched.num_preemptions > 0
    assert old.finished and new.finished and len(new.output_ids) == 12
    assert sched.block_manager.num_free == 5


def test_no_starvation_under_a_steady_stream():
    sched = make(num_blocks=24, budget=16, max_seqs=4)
    arrived = []
    for step in range(60):
        arrived.append(seq(5, f"r{step}"))  # a new request every step: more than can run
        sched.add(arrived[-1])
        advance(sched, max_new=6)
    done = [s.finished for s in arrived]
    assert done[0] and sum(done) > 10
    # first come, first served: every finished request arrived before every waiting one
    last_done = max(i for i, d in enumerate(done) if d)
    first_waiting = min(i for i, s in enumerate(arrived) if s in sched.waiting)
    assert last_done < first_waiting + len(sched.running) + 1
