"""The asyncio front: concurrent streams equal the synchronous engine; cancel frees blocks."""

import asyncio

from edgellm.engine.outputs import RequestOutput
from edgellm.entrypoints.async_engine import AsyncEngine
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
