"""The worker's engine without Dynamo: SGLang's host pool and controller over kvcr, two in one process.

B serves a prompt that A computed, with a hint naming A: SGLang's controller leases and reads A's
pages over NIXL, and each one is checked against the bytes its prefix determines. A model whose
idea of one page's bytes is wrong must notice (the check can fail).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcr.demo.dynamo.worker_model import StandInModel, prepare_sglang
from kvcr.demo.dynamo.worker_settings import parse_worker_args
from kvcr.domain.keys import page_hashes, router_id
from tests.support import free_port

pytestmark = [pytest.mark.nixl, pytest.mark.sglang]
PAGE = 16
MODEL = str(Path(__file__).parent)  # any directory stands for a model directory here (the worker checks it is one)


class Misremembering(StandInModel):
    """Believes one page (the third of every prompt) holds other bytes than its prefix determines."""

    wrong_key: str | None = None

    def expected_page(self, page_key: str):
        return super().expected_page("0" * 64 if page_key == self.wrong_key else page_key)


def model(cls=StandInModel):
    prepare_sglang()
    args = ["--model", MODEL, "--control-port", str(free_port()), "--kv-events-port", str(free_port())]
    return cls(parse_worker_args([*args, "--page-kib", "32", "--host-pages", "64"]))


def hint(source: StandInModel, keys: list[str], request_id: str) -> dict:
    payload = {
        "source_control_endpoint": source.settings.control_endpoint,
        "block_hashes": [router_id(k) for k in keys],
    }
    action = {"action_id": "a1", "action_type": "kv.fetch", "action_version": "1.0", "payload": payload}
    return {"protocol_version": "0.1", "message_id": request_id, "actions": [action]}


@pytest.fixture(scope="module")
def pair():
    a, b = model(), model(Misremembering)
    yield a, b
    a.close()
    b.close()


def test_b_restores_as_pages_from_a_on_a_hint_and_verifies_each(pair):
    a, b = pair
    tokens = list(range(1000, 1000 + 5 * PAGE + 3))
    first = a.serve("r1", tokens, None)
    assert (first.computed_pages, first.backed_up_pages, first.verified) == (5, 5, None)
    assert a.serve("r2", tokens, None).local_pages == 5  # A's own kvcr, locally
    keys = page_hashes(tokens[: 5 * PAGE], PAGE)
    served = b.serve("r3", tokens, hint(a, keys[:4], "r3"))  # the router hints the prefix A holds
    assert (served.peer_pages, served.local_pages, served.computed_pages) == (4, 0, 1)
    assert served.verified is True and served.restored_bytes == 4 * b.page_bytes
    assert served.backed_up_pages == 5  # now B's own kvcr holds the whole prompt
    assert b.serve("r4", tokens, None).local_pages == 5


def test_a_page_with_other_bytes_than_its_prefix_is_reported(pair):
    a, b = pair
    tokens = list(range(3000, 3000 + 4 * PAGE))
    a.serve("r5", tokens, None)
    keys = page_hashes(tokens, PAGE)
    b.wrong_key = keys[2]
    served = b.serve("r6", tokens, hint(a, keys, "r6"))
    assert served.peer_pages == 4 and served.mismatched_pages == 1 and served.verified is False


def test_without_a_hint_nothing_comes_from_a_peer(pair):
    a, b = pair
    tokens = list(range(5000, 5000 + 3 * PAGE))
    a.serve("r7", tokens, None)
    served = b.serve("r8", tokens, None)
    assert (served.peer_pages, served.computed_pages) == (0, 3)
