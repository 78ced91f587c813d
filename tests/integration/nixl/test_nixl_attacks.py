"""A peer holding our description attacks with raw NIXL, from its own process.

The victim is a kvcr data plane (``plane_server``) with an exposed arena and private host pages,
as a replica registers them. The attacker loads the NIXL metadata from the victim's description
into a raw NIXL agent and tries what issue 9 did with the full metadata: READ and WRITE the host
pages, READ past the arena's end. NIXL refuses each of them at the attacker (the metadata names
no other memory); a READ inside the arena works, so the refusals are not a broken connection.
What this cannot stop (a peer that forges metadata) is in docs/nixl-behaviour.md, section 1.
"""

import json

import pytest

from tests.integration.nixl.support import plane_server, run_python

pytestmark = [pytest.mark.nixl, pytest.mark.multiprocess]

KIB = 1024

ATTACKER = """
import json, sys
import msgspec, numpy as np
from nixl._api import nixl_agent, nixl_agent_config

target = json.loads(sys.argv[1])
agent = nixl_agent("attacker", nixl_agent_config(enable_prog_thread=False, backends=[]))
agent.create_backend("UCX", {"ucx_devices": "lo"})
loot = np.full(64 * 1024, 0x5A, dtype=np.uint8)
agent.register_memory([(loot.ctypes.data, loot.nbytes, 0, "")], "DRAM")
fields = msgspec.msgpack.decode(bytes.fromhex(target["description"]))
peer = agent.add_remote_agent(fields["metadata"])
peer = peer.decode() if isinstance(peer, bytes) else peer

def attempt(op, address, nbytes):
    try:
        local = agent.get_xfer_descs(np.array([[loot.ctypes.data, nbytes, 0]], dtype=np.uint64), "DRAM")
        remote = agent.get_xfer_descs(np.array([[address, nbytes, 0]], dtype=np.uint64), "DRAM")
        xfer = agent.initialize_xfer(op, local, remote, peer)
        state = agent.transfer(xfer)
        for _ in range(200000):
            if state != "PROC":
                break
            state = agent.check_xfer_state(xfer)
        return state
    except Exception as exc:
        return f"refused: {type(exc).__name__}"

arena, host = target["arena"], target["host"]
results = {
    "read arena": attempt("READ", arena["base"], 4096),
    "read host": attempt("READ", host["base"], 4096),
    "write host": attempt("WRITE", host["base"] + 4096, 4096),
    "read one byte past the arena": attempt("READ", arena["base"] + arena["nbytes"] - 4095, 4096),
    "read the arena and one more byte": attempt("READ", arena["base"], arena["nbytes"] + 1),
}
print(json.dumps(results))
"""


@pytest.mark.parametrize("env", [{}, {"UCX_TLS": "tcp"}], ids=["cma", "tcp"])
def test_a_peer_cannot_reach_host_pages_or_past_the_arena(env):
    victim = plane_server("victim", **env)
    try:
        arena = victim.ask("region", label="arena", count=8, piece=4 * KIB, seed=1, exposed=True)
        host = victim.ask("region", label="host", count=8, piece=4 * KIB, seed=2, exposed=False)
        before = victim.ask("digest", label="host"), victim.ask("digest", label="arena")
        target = {"description": victim.ask("describe")["description"], "arena": arena, "host": host}
        results, _ = run_python(
            "import sys; sys.argv[1:] = [" + repr(json.dumps(target)) + "]\n" + ATTACKER, timeout=120, **env
        )
        assert results.pop("read arena") == "DONE", "the attack path itself must work"
        assert results == dict.fromkeys(results, "refused: nixlNotFoundError"), results
        assert (victim.ask("digest", label="host"), victim.ask("digest", label="arena")) == before
    finally:
        victim.close()
