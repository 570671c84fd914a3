"""The TCP sockets between nodes (distributed/curve.py): a peer given the keys talks to a guarded socket; one without
them, or with keys of its own, is refused in the handshake and delivers nothing."""

from __future__ import annotations

import contextlib

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from banyan.distributed.curve import ENV, Guard, secure_connect

REFUSED_WITHIN_MS = 3000


@pytest.fixture
def guarded():
    """A PULL socket on 127.0.0.1 behind a Guard: (context, guard, socket, address)."""
    context = zmq.Context()
    guard = Guard(context)
    pull = context.socket(zmq.PULL)
    guard.serve(pull)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    yield context, guard, pull, f"tcp://127.0.0.1:{port}"
    guard.stop()
    context.destroy(linger=0)  # every socket, those of a failed test too


def handshake(sock: zmq.Socket, address: str) -> int | None:
    """Connect `sock` and return how its first handshake ended (a zmq.EVENT_HANDSHAKE_* value), or None when none
    ended within REFUSED_WITHIN_MS (the monitor is attached before the connect, so no event is missed)."""
    ends = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
    monitor = sock.get_monitor_socket(ends)
    sock.connect(address)
    try:
        return recv_monitor_message(monitor)["event"] if monitor.poll(REFUSED_WITHIN_MS) else None
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)


def forge(push: zmq.Socket) -> None:
    """Try to send a step: a refused peer has no connection to queue it on (zmq.Again), or queues it in vain."""
    with contextlib.suppress(zmq.Again):
        push.send(b"forged step", zmq.NOBLOCK)


def test_a_peer_with_the_keys_is_heard(guarded, monkeypatch):
    context, guard, pull, address = guarded
    monkeypatch.setenv(ENV, guard.env[ENV])  # as a started core or worker finds them
    push = context.socket(zmq.PUSH)
    secure_connect(push, address)
    push.send(b"step 1")
    assert pull.poll(5000) and pull.recv() == b"step 1"
    push.close(linger=0)


def test_a_peer_with_its_own_client_keys_is_refused(guarded):
    """It knows the guarded socket's public key but not the peers' key pair: the ZAP handler says no."""
    context, guard, pull, address = guarded
    push = context.socket(zmq.PUSH)
    push.curve_serverkey = guard.keys.server_public.encode()
    push.curve_publickey, push.curve_secretkey = zmq.curve_keypair()
    assert handshake(push, address) == zmq.EVENT_HANDSHAKE_FAILED_AUTH
    forge(push)
    assert not pull.poll(500)
    push.close(linger=0)


def test_a_peer_without_keys_is_refused(guarded):
    context, _, pull, address = guarded
    plain = context.socket(zmq.PUSH)  # no CURVE at all: the mechanisms do not match
    assert handshake(plain, address) == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    guess = context.socket(zmq.PUSH)  # CURVE, with a guess at the guarded socket's key
    guess.curve_serverkey = zmq.curve_keypair()[0]
    guess.curve_publickey, guess.curve_secretkey = zmq.curve_keypair()
    guess.connect(address)
    for push in (plain, guess):
        forge(push)
    assert not pull.poll(1000)
    for push in (plain, guess):
        push.close(linger=0)


def test_a_tcp_peer_started_without_keys_fails_at_once(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    context = zmq.Context()
    sock = context.socket(zmq.SUB)
    with pytest.raises(RuntimeError, match="holds no keys"):
        secure_connect(sock, "tcp://127.0.0.1:5555")
    secure_connect(sock, "ipc:///tmp/banyan-test-nowhere")  # a Unix socket needs none
    sock.close(linger=0)
    context.term()
