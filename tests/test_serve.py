"""frontend/serve.py's own pieces, without starting a server."""
import socket

from pantheon.frontend.serve import http_socket


def test_accepted_connections_do_not_wait_for_delayed_acks():
    # Nagle on the server side held a response's body until the client's delayed ACK
    # of its headers: ~44 ms on every reused connection (a router's pool, the SDK's),
    # 0.2 ms with TCP_NODELAY, measured on loopback
    listener = http_socket("127.0.0.1", 0)
    listener.listen()
    client = socket.create_connection(listener.getsockname())
    accepted, _ = listener.accept()
    try:
        assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    finally:
        accepted.close(), client.close(), listener.close()


def test_worker_lost_after_leaves_room_for_a_probe():
    """A silent worker is probed after 1 s: a shorter loss deadline would lose live ones."""
    import pytest
    from pantheon.frontend.serve import ServeConfig
    with pytest.raises(ValueError, match="at least 2 seconds"):
        ServeConfig(models=[], worker_timeout_s=1.0, worker_lost_after_s=1.5)
    assert ServeConfig(models=[], worker_timeout_s=1.0, worker_lost_after_s=2.0)
