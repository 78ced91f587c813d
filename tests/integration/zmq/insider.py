"""A hostile token holder in its own process (``python -m tests.integration.zmq.insider``).

It holds the cluster token (so CURVE admits it), or with per-node identities its own listed key
(``--node-key-file`` and ``--directory``), and speaks the peer protocol with raw pyzmq DEALERs: its
own connections, no kvcr client code in between. Every command may say ``"connection": n`` to go
over its n-th connection (opened at first use; 0 by default). It reads one JSON command per stdin
line and answers each with one JSON line:

- ``{"do": "release", "session": s, "lease_ids": [...]}``: a one-way RELEASE under session ``s``;
  answers ``{"sent": true}``.
- ``{"do": "lease", "session": s, "pages": [[pool id, [page hash, ...]], ...], "lease_ms": n}``:
  a LEASE under session ``s``; answers the reply (``{"lease_id": .., "slots": ..}`` or
  ``{"refused": code}``).
- ``{"do": "hello", "namespaces": {pool: digest}}``: opens a session of its own; answers
  ``{"session": s, "pools": {name: id}, "regions": {name: [region id, ...]}, "description": hex}``
  or ``{"refused": code}``.

End of input closes the socket and exits.
"""

from __future__ import annotations

import argparse
import itertools
import json
import secrets
import sys
from pathlib import Path
from typing import Any

import zmq

from kvcr.adapters.zmq.curve import Keyring
from kvcr.adapters.zmq.identity import NodeIdentity, PeerDirectory
from kvcr.domain.hints import Endpoint
from kvcr.runner import protocol

_IDS = itertools.count(1)


class _Failed(Exception):
    """The control server answered with its failure status (e.g. a revoked node): what it said."""


def _ask(sock: zmq.Socket[bytes], message: protocol.Message) -> protocol.Message:
    request_id = next(_IDS).to_bytes(8, "big")
    sock.send_multipart([request_id, protocol.encode(message)])
    if not sock.poll(5000):
        raise TimeoutError("no reply within 5 s")
    frames = sock.recv_multipart()
    assert frames[0] == request_id, frames[:1]
    if frames[1] != b"\x00":
        raise _Failed(frames[2].decode("utf-8", "replace"))
    return protocol.decode(frames[2])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--token-file")
    parser.add_argument("--node-key-file")
    parser.add_argument("--directory")
    parser.add_argument("--own-endpoint", help="where the directory lists the insider's own key")
    args = parser.parse_args()
    context = zmq.Context()
    socks: dict[int, zmq.Socket[bytes]] = {}

    def connection(n: int) -> zmq.Socket[bytes]:
        if n not in socks:
            sock = context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 1000)
            if args.node_key_file:
                key, directory = Path(args.node_key_file).read_bytes(), PeerDirectory(args.directory)
                identity = NodeIdentity(key, directory, str(Endpoint.parse(args.own_endpoint)))
                identity.configure_client(sock, 0, str(Endpoint.parse(args.endpoint)))
            else:
                Keyring(Path(args.token_file).read_bytes()).configure_client(sock, 0)
            sock.connect(args.endpoint)
            socks[n] = sock
        return socks[n]

    for line in sys.stdin:
        command = json.loads(line)
        sock = connection(command.get("connection", 0))
        try:
            answer = _answer(sock, command)
        except _Failed as failed:
            answer = {"failed": str(failed)}
        print(json.dumps(answer), flush=True)
    for sock in socks.values():
        sock.close()
    context.term()


def _answer(sock: zmq.Socket[bytes], command: dict[str, Any]) -> dict[str, object]:
    nonce = secrets.token_bytes(protocol.NONCE_BYTES)
    answer: dict[str, object]
    if command["do"] == "release":
        release = protocol.Release(command["session"], command["lease_ids"])
        sock.send_multipart([bytes(8), protocol.encode(release)])
        answer = {"sent": True}
    elif command["do"] == "hello":
        reply = _ask(sock, protocol.Hello(nonce, "insider", "insider", command["namespaces"]))
        if isinstance(reply, protocol.HelloReply):
            answer = {
                "session": reply.session,
                "pools": {p.name: p.pool_id for p in reply.pools},
                "regions": {p.name: p.regions for p in reply.pools},  # each component's region id
                "description": reply.data_plane.hex(),  # what a peer's data plane reads with
            }
        else:
            answer = {"refused": getattr(reply, "code", None)}
    else:
        pages = [(pool_id, hashes) for pool_id, hashes in command["pages"]]
        reply = _ask(sock, protocol.Lease(nonce, command["session"], command.get("lease_ms", 10_000), pages))
        if isinstance(reply, protocol.LeaseReply):
            digests = [[d.hex() for d in pool] for pool in reply.digests]
            answer = {"lease_id": reply.lease_id, "slots": reply.slots, "ttl_ms": reply.ttl_ms, "digests": digests}
        else:
            answer = {"refused": getattr(reply, "code", None)}
    return answer


if __name__ == "__main__":
    main()
