"""The asyncio front: concurrent streams equal the synchronous engine; cancel frees blocks."""

import asyncio

import pytest

from edgellm.engine.outputs import RequestOutput
from edgellm.entrypoints.async_engine import AsyncEngine, QueueFullError
from edgellm.errors import ContextLengthError, InvalidParameterError, RequestFailedError
from edgellm.sampling.params import SamplingParams
from tests.conftest import run_all, tiny_engine

GREEDY = SamplingParams(temperature=0, max_tokens=20)
PROMPTS = [list(range(1, 1 + 7 * k)) for k in range(1, 7)]


async def collect(aeng, prompt, params):
    text, final = "", None
    async for item in aeng.generate(prompt, params):
        if isinstance(item, RequestOutput):
            final = item
        elif item.index == 0:
            text += item.text
    return text, final


def test_concurrent_streams_equal_sync_engine():
    ref = run_all(tiny_engine(), PROMPTS, GREEDY)
    aeng = AsyncEngine(tiny_engine())

    async def main():
        return await asyncio.gather(*(collect(aeng, p, GREEDY) for p in PROMPTS))

    try:
        results = asyncio.run(main())
    finally:
        aeng.shutdown()
    for (text, final), r in zip(results, ref, strict=True):
        assert final.outputs[0].token_ids == r.outputs[0].token_ids
        assert text == r.outputs[0].text
        assert final.outputs[0].finish_reason == "length"


def test_cancelled_consumer_aborts_and_frees_blocks():
    eng = tiny_engine(block_size=4)
    aeng = AsyncEngine(eng)

    async def main():
        agen = aeng.generate(list(range(1, 30)), SamplingParams(max_tokens=10_000, ignore_eos=True))
        async for _ in agen:
            break  # the client goes away after the first delta
        await agen.aclose()
        await asyncio.sleep(0.05)

    try:
        asyncio.run(main())
        m = aeng.metrics()
    finally:
        aeng.shutdown()
    assert m["running"] == 0 and m["waiting"] == 0 and m["blocks_used"] == 0


def test_a_failing_request_fails_alone():
    """A request whose step raises (params made invalid after validation, so the sampler's
    top-k logprobs fail) gets the error in its stream; a concurrent stream completes as in the
    synchronous engine, and the engine serves the next request."""
    ref = run_all(tiny_engine(), [PROMPTS[2]], GREEDY)[0]
    aeng = AsyncEngine(tiny_engine())
    bad = SamplingParams(temperature=0, max_tokens=20, logprobs=1)
    bad.logprobs = 10**6  # more alternatives than the vocabulary has: torch.topk raises

    async def main():
        good = asyncio.create_task(collect(aeng, PROMPTS[2], GREEDY))
        failed = asyncio.create_task(collect(aeng, PROMPTS[1], bad))
        errors = await asyncio.gather(failed, return_exceptions=True)
        return errors[0], await good, await collect(aeng, PROMPTS[2], GREEDY)

    try:
        error, (text, final), (again, _) = asyncio.run(main())
        m = aeng.metrics()
    finally:
        aeng.shutdown()
    assert isinstance(error, RequestFailedError) and "internal error" in str(error)
    assert final.outputs[0].token_ids == ref.outputs[0].token_ids
    assert text == again == ref.outputs[0].text
    assert (m["running"], m["waiting"], m["blocks_used"]) == (0, 0, 0)


def test_bad_requests_fail_at_add_and_n_counts_against_the_limits():
    """Errors of `add` are the request's alone; a request's n sequences all count against
    max_num_seqs (n above it is refused) and the room for waiting ones (429 when full)."""
    aeng = AsyncEngine(tiny_engine(max_num_seqs=4), max_waiting=2)
    long = dict(max_tokens=10_000, ignore_eos=True)

    async def main():
        with pytest.raises(InvalidParameterError, match="max_num_seqs"):
            await aeng.add([1, 2, 3], SamplingParams(n=5))
        with pytest.raises(ContextLengthError):
            await aeng.add(list(range(1, 200)) * 10, GREEDY)
        ids = [await aeng.add([1, 2, 3], SamplingParams(n=4, **long))]
        ids.append(await aeng.add([4, 5], SamplingParams(**long)))  # 5 of 4 + 2 in flight
        with pytest.raises(QueueFullError):  # 2 more would make 7
            await aeng.add([6, 7], SamplingParams(n=2, **long))
        ids.append(await aeng.add([6, 7], SamplingParams(**long)))  # 1 more fits
        for rid in ids:
            aeng.abort(rid)
        while aeng.metrics()["running"] or aeng.metrics()["waiting"]:
            await asyncio.sleep(0.02)

    try:
        asyncio.run(asyncio.wait_for(main(), 30))
        m = aeng.metrics()
    finally:
        aeng.shutdown()
    assert m["blocks_used"] == 0
