"""The preparation pool (frontend/preparer.py): a deadline per request, queue included."""
import asyncio
import threading

import pytest

from pantheon.frontend.errors import APIError
from pantheon.frontend.preparer import Preparer


def test_work_past_the_deadline_is_a_503_and_work_not_begun_is_dropped():
    release, ran = threading.Event(), []

    def slow():
        release.wait(10)
        return "slow"

    async def go():
        prep = Preparer(timeout_s=0.3, threads=1)
        assert await prep.run(prep.deadline(), lambda: 7) == 7
        deadline = prep.deadline()
        busy = asyncio.ensure_future(prep.run(deadline, slow))     # holds the one thread
        queued = asyncio.ensure_future(prep.run(deadline, ran.append, "queued"))
        for task in (busy, queued):
            with pytest.raises(APIError) as exc:
                await task
            assert exc.value.status == 503 and exc.value.code == "prepare_timeout"
        release.set()
        assert await prep.run(prep.deadline(), lambda: "after") == "after"
        assert ran == []                          # the queued work never ran
        prep.close()
    asyncio.run(go())


def test_an_error_in_the_work_is_raised_as_is():
    def refuse():
        raise APIError(400, "bad", param="messages")

    async def go():
        prep = Preparer(timeout_s=5, threads=1)
        with pytest.raises(APIError) as exc:
            await prep.run(prep.deadline(), refuse)
        assert exc.value.param == "messages"
        prep.close()
    asyncio.run(go())


def test_a_small_request_never_waits_behind_large_ones():
    release = threading.Event()

    async def go():
        prep = Preparer(timeout_s=10, threads=1)
        big = asyncio.ensure_future(prep.run(prep.deadline(), release.wait, 10,
                                             size=1 << 20))
        await asyncio.sleep(0.05)
        assert await prep.run(prep.deadline(), lambda: "small", size=100) == "small"
        assert not big.done()
        release.set()
        assert await big is True
        prep.close()
    asyncio.run(go())
