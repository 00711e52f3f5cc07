"""The admission queue: fast path, FIFO wait, 429/503 with Retry-After."""
import asyncio
from types import SimpleNamespace

import pytest

from pantheon.frontend.admission import Admission
from pantheon.frontend.openai_api import APIError
from pantheon.frontend.registry import Replica, ReplicaState


def model(*slots, pressure=0):
    worker = SimpleNamespace(pressure=pressure, slow=False)
    replicas = [Replica(f"m#{i}", "cpu", ReplicaState.READY, slots=n, worker=worker)
                for i, n in enumerate(slots)]
    return SimpleNamespace(name="m", replicas=replicas, ready=lambda: replicas, worker=worker)


def run(coro):
    return asyncio.run(coro)


def test_fast_path_spreads_over_replicas_by_load():
    async def go():
        adm, m = Admission(), model(2, 2)
        got = [await adm.acquire(m) for _ in range(4)]
        assert [r.model_id for r in got] == ["m#0", "m#1", "m#0", "m#1"]
        assert [r.inflight for r in m.replicas] == [2, 2]
    run(go())


def test_a_slow_worker_gets_no_new_requests_while_another_can_serve():
    async def go():
        adm, m = Admission(depth=4, timeout_s=5), model(2, 2)
        m.replicas[0].worker = SimpleNamespace(pressure=0, slow=True)
        got = [await adm.acquire(m) for _ in range(2)]
        assert [r.model_id for r in got] == ["m#1", "m#1"]
        waiter = asyncio.ensure_future(adm.acquire(m))   # the fast one is full: wait for it
        await asyncio.sleep(0.01)
        assert not waiter.done()
        m.replicas[0].worker.slow = False                 # ready again
        adm.wake_all()
        assert (await asyncio.wait_for(waiter, 1)).model_id == "m#0"
        for r in m.replicas:                              # every replica slow: they serve
            r.worker = SimpleNamespace(pressure=0, slow=True)
        m.replicas[0].inflight = 0
        assert (await adm.acquire(m)).model_id == "m#0"
    run(go())


def test_waiters_are_served_in_order_when_slots_free():
    async def go():
        adm, m = Admission(depth=4, timeout_s=5), model(2)
        held = [await adm.acquire(m), await adm.acquire(m)]
        waiters = [asyncio.ensure_future(adm.acquire(m)) for _ in range(3)]
        await asyncio.sleep(0.01)
        assert adm.queued(m) == 3 and not any(w.done() for w in waiters)
        adm.release(m, held[1])
        assert await asyncio.wait_for(waiters[0], 1) is m.replicas[0]
        await asyncio.sleep(0.01)
        assert [w.done() for w in waiters] == [True, False, False]
        adm.release(m, held[0])
        await asyncio.wait_for(waiters[1], 1)
        await asyncio.sleep(0.01)
        assert not waiters[2].done() and m.replicas[0].inflight == 2
        waiters[2].cancel()
    run(go())


@pytest.mark.parametrize("pressure, status, retry", [(0, 429, "5"), (3, 503, "5")])
def test_full_queue_is_refused(pressure, status, retry):
    async def go():
        adm, m = Admission(depth=1, timeout_s=5, pressure=lambda: 0), model(2, pressure=0)
        await adm.acquire(m), await adm.acquire(m)
        waiter = asyncio.ensure_future(adm.acquire(m))
        await asyncio.sleep(0)
        m.worker.pressure = pressure
        with pytest.raises(APIError) as err:
            await adm.acquire(m)
        waiter.cancel()
        return err.value
    err = run(go())
    assert err.status == status and err.headers["Retry-After"] == retry


def test_waiting_too_long_is_a_429_with_retry_after_2():
    async def go():
        adm, m = Admission(depth=4, timeout_s=0.05), model(2)
        await adm.acquire(m), await adm.acquire(m)
        with pytest.raises(APIError) as err:
            await adm.acquire(m)
        assert adm.queued(m) == 0
        return err.value
    err = run(go())
    assert err.status == 429 and err.code == "queue_timeout" and err.headers["Retry-After"] == "2"


def test_single_user_mode_refuses_at_once():
    async def go():
        adm, m = Admission(depth=4, timeout_s=5), model(1)
        held = await adm.acquire(m)
        with pytest.raises(APIError) as err:
            await adm.acquire(m)
        assert err.value.status == 429 and err.value.code == "server_busy"
        adm.release(m, held)
        assert await adm.acquire(m) is held           # free again: fast path
    run(go())


def test_critical_pressure_holds_the_fast_path_until_it_drops():
    async def go():
        adm, m = Admission(depth=4, timeout_s=5, pressure=lambda: 0), model(4, pressure=3)
        waiter = asyncio.ensure_future(adm.acquire(m))
        await asyncio.sleep(0)
        assert not waiter.done()
        await asyncio.sleep(0.01)
        assert not waiter.done()
        m.worker.pressure = 0
        adm.wake_all()                                  # a heartbeat brought better news
        assert (await asyncio.wait_for(waiter, 1)).inflight == 1
    run(go())


def test_shutdown_fails_waiters_and_new_requests_with_503():
    async def go():
        adm, m = Admission(depth=4, timeout_s=5), model(1, 1)
        await adm.acquire(m), await adm.acquire(m)
        m.replicas[0].slots = m.replicas[1].slots = 2   # not single-user: it queues
        m.replicas[0].inflight = m.replicas[1].inflight = 2
        waiter = asyncio.ensure_future(adm.acquire(m))
        await asyncio.sleep(0)
        adm.close()
        with pytest.raises(APIError) as err:
            await waiter
        assert err.value.status == 503
        with pytest.raises(APIError) as err:
            await adm.acquire(m)
        assert err.value.status == 503 and err.value.code == "shutting_down"
    run(go())


def test_a_session_sticks_to_its_replica_until_that_one_is_saturated():
    async def go():
        adm, m = Admission(), model(2, 2)
        first = await adm.acquire(m, "s1")
        adm.release(m, first)
        other = await adm.acquire(m, "s2")            # least loaded: the same one (ties)
        assert other is first
        # s1 returns while its replica holds one request: it still goes home
        assert await adm.acquire(m, "s1") is first
        assert first.inflight == 2                     # now saturated
        moved = await adm.acquire(m, "s1")             # so s1 moves, and stays moved
        assert moved is not first
        adm.release(m, moved)
        assert await adm.acquire(m, "s1") is moved
    run(go())
