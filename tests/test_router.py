"""The router: a request group goes to one replica; sessions stick to theirs."""
from types import SimpleNamespace

from pantheon.frontend.registry import Replica, ReplicaState
from pantheon.frontend.router import Router


def model(*slots):
    replicas = [Replica(f"m#{i}", f"cpu:{i}", ReplicaState.READY, slots=n,
                        worker=SimpleNamespace(pressure=0, slow=False))
                for i, n in enumerate(slots)]
    return SimpleNamespace(name="m", replicas=replicas, ready=lambda: replicas)


def test_a_group_goes_to_one_replica_with_room_for_all_of_it():
    router, m = Router(), model(4, 4)
    m.replicas[0].inflight = 1
    assert router.pick(m, None, 4) is m.replicas[1]        # 1 + 4 > 4 on the first
    assert router.pick(m, None, 3) is m.replicas[1]        # fewest in flight first
    m.replicas[1].inflight = 2
    assert router.pick(m, None, 3) is m.replicas[0]        # only the first has 3 free
    assert router.pick(m, None, 4) is None                 # nobody has 4 free: wait


def test_a_group_larger_than_any_replica_runs_on_an_idle_one():
    router, m = Router(), model(2, 2)
    m.replicas[0].inflight = 1
    assert router.pick(m, None, 5) is m.replicas[1]        # the worker queues what exceeds
    m.replicas[1].inflight = 1
    assert router.pick(m, None, 5) is None


def test_slow_workers_are_left_out_while_another_can_serve():
    router, m = Router(), model(2, 2)
    m.replicas[1].worker.slow = True
    m.replicas[0].inflight = 1
    assert router.pick(m, None, 1) is m.replicas[0]
    m.replicas[0].inflight = 2
    assert router.pick(m, None, 1) is None                 # the fast one is full: wait
    m.replicas[0].worker = SimpleNamespace(slow=True)
    assert router.pick(m, None, 1) is m.replicas[1]        # every one slow: they serve


def test_sessions_stick_to_their_replica_while_it_has_room_then_move_and_stay():
    router, m = Router(), model(2, 2)
    home = router.pick(m, "s", 1)
    router.routed(home, "s")
    home.inflight = 1
    other = next(r for r in m.replicas if r is not home)
    assert router.pick(m, "s", 1) is home                  # busier, but it holds the prefix
    assert router.pick(m, "t", 1) is other                 # a stranger goes to the idle one
    assert router.pick(m, "s", 2) is other                 # the group does not fit at home
    router.routed(other, "s")
    home.inflight = 0
    assert router.pick(m, "s", 1) is other                 # moved, and stays moved


def test_the_session_table_is_bounded():
    router, m = Router(), model(1)
    router.AFFINITY_SESSIONS = 3
    for i in range(5):
        router.routed(m.replicas[0], f"s{i}")
    assert list(router.affinity) == ["s2", "s3", "s4"]


def test_only_replicas_whose_context_holds_the_group_are_candidates():
    router, m = Router(), model(4, 4)
    m.replicas[0].ctx, m.replicas[1].ctx = 512, 4096
    m.replicas[1].inflight = 3                   # busier, but the only one that holds 661
    assert router.pick(m, None, 1, need=661) is m.replicas[1]
    assert router.pick(m, None, 1, need=300) is m.replicas[0]     # both hold it: fewest
    m.replicas[1].inflight = 4
    assert router.pick(m, None, 1, need=661) is None              # wait for the big one
    assert router.pick(m, None, 1, need=5000) is None
