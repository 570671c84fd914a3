"""CURVE on the ZeroMQ sockets that cross nodes. With a Ray backend the engine client's two sockets per core and a
tensor/pipeline group's step socket are TCP ports on the nodes' addresses, where anyone who reaches the port could
send a core requests or read its steps; locally they are Unix sockets in a 0700 directory and need nothing more.

    binding side (the engine client; rank 0)                     connecting side (the core; ranks 1..N-1)
    guard = Guard(context)         ── env BANYAN_SOCKET_KEYS ──►  secure_connect(sock, address)
    guard.serve(sock); sock.bind("tcp://...")                      (the keys read from its environment)

Two key pairs, both made by the binding side: its own (the peer needs its public key to begin the handshake) and
the peers' (the only client key the guard's ZAP handler admits). A peer without them fails the handshake: it can
neither send a message nor receive one, and the traffic is encrypted. The keys travel in the started process's
environment, never on its command line (world-readable in /proc); to a Ray actor, inside Ray's actor-creation call
(whoever controls the cluster controls its processes anyway).

Not covered: torch.distributed's TCP store and gloo connections between ranks on different nodes, which torch
offers no authentication for (docs/parallel.md).
"""

from __future__ import annotations

import os

import msgspec
import zmq
from zmq.auth.thread import ThreadAuthenticator

ENV = "BANYAN_SOCKET_KEYS"


class SocketKeys(msgspec.Struct, frozen=True):
    """Z85-encoded CURVE keys: the binding side's pair and the connecting side's pair."""

    server_public: str
    server_secret: str
    client_public: str
    client_secret: str

    @classmethod
    def generate(cls) -> SocketKeys:
        (server_public, server_secret), (client_public, client_secret) = zmq.curve_keypair(), zmq.curve_keypair()
        return cls(server_public.decode(), server_secret.decode(), client_public.decode(), client_secret.decode())

    @classmethod
    def from_env(cls) -> SocketKeys | None:
        raw = os.environ.get(ENV)
        return msgspec.json.decode(raw, type=cls) if raw else None


class Guard:
    """The binding side: fresh keys, and a ZAP handler on `context` (a ZeroMQ or zmq.asyncio context) that admits
    only the peers' public key. Call stop() before the context is terminated."""

    def __init__(self, context: zmq.Context):
        self.keys = SocketKeys.generate()
        self._auth = ThreadAuthenticator(zmq.Context.shadow(context.underlying))  # a thread: any context kind
        self._auth.start()
        self._auth.configure_curve_callback("*", _AdmitOnly(self.keys.client_public.encode()))

    @property
    def env(self) -> dict[str, str]:
        """What the started process's environment must hold."""
        return {ENV: msgspec.json.encode(self.keys).decode()}

    def serve(self, sock: zmq.Socket) -> None:
        """Make `sock` a CURVE server (before it binds)."""
        sock.curve_secretkey = self.keys.server_secret.encode()
        sock.curve_publickey = self.keys.server_public.encode()
        sock.curve_server = True

    def stop(self) -> None:
        self._auth.stop()


class _AdmitOnly:
    def __init__(self, public_key: bytes):
        self.public_key = public_key

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self.public_key


def secure_connect(sock: zmq.Socket, address: str) -> None:
    """Connect to a binding side's socket: over TCP as a CURVE client with the keys from this process's
    environment (RuntimeError without them, rather than a handshake that never completes); a Unix socket as is."""
    if address.startswith("tcp://"):
        keys = SocketKeys.from_env()
        if keys is None:
            raise RuntimeError(f"{address} is a TCP socket between nodes, and ${ENV} holds no keys for it")
        sock.curve_serverkey = keys.server_public.encode()
        sock.curve_publickey = keys.client_public.encode()
        sock.curve_secretkey = keys.client_secret.encode()
    sock.connect(address)
