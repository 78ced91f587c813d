"""kvcr under SGLang 0.5.23's real scheduler: real servers, a real model, real HTTP requests.

Three servers start once for the module (in parallel, ~1-2 minutes on a 2-core machine):

* A and B: kvcr as L3 over NIXL on loopback; B follows hints (``enable_remote_hint``).
* C: the same as A, with the harness's corruption control on (``KVCR_ENGINE_CORRUPT_RESTORES``):
  the pages kvcr restores are overwritten in SGLang's host pool after kvcr is done, so the
  equality checks below are shown able to fail.

Every request is greedy with logprobs. ``cached_tokens`` is SGLang's own count of prompt tokens it
did not compute; ``kvcr_pages_total`` is kvcr's counter on SGLang's ``/metrics``.
"""

import signal
import time

import pytest

from kvcr.testing.engine import (
    PAGE_SIZE,
    EngineServer,
    fetch_hint,
    prompt_ids,
    start_all,
    stop_all,
    wait_for,
    write_model,
)
from kvcr.testing.processes import wait_until_stopped

PROMPT_TOKENS = 544  # 34 pages; SGLang computes at least the last token, so 33 pages can be reused
REUSABLE = (PROMPT_TOKENS - 1) // PAGE_SIZE * PAGE_SIZE
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine")
    model = write_model(root / "model", seed=7)
    a = EngineServer(model, root / "a.log")
    b = EngineServer(model, root / "b.log", kvcr_settings={"enable_remote_hint": True})
    c = EngineServer(model, root / "c.log", env={"KVCR_ENGINE_CORRUPT_RESTORES": "1"})
    started = time.monotonic()
    start_all([a, b, c])
    print(f"three servers up in {time.monotonic() - started:.1f} s")
    yield {"a": a, "b": b, "c": c}
    stop_all([a, b, c])


def answer(reply):
    meta = reply["meta_info"]
    return reply["output_ids"], [round(lp[0], 6) for lp in meta["output_token_logprobs"]]


PAGES = REUSABLE // PAGE_SIZE


def backed_up(server, before, pages=PAGES):
    """Wait until ``pages`` more pages than ``before`` reached kvcr DRAM (write_through backs up asynchronously)."""
    wait_for(lambda: server.kvcr_pages("backup") - before >= pages, 30.0, f"{pages} pages backed up into kvcr DRAM")


def test_flushed_prompt_is_restored_from_kvcr_dram(servers):
    a = servers["a"]
    ids = prompt_ids(PROMPT_TOKENS, seed=1)
    backups = a.kvcr_pages("backup")
    cold = a.generate(ids, max_new_tokens=NEW_TOKENS)
    assert cold["meta_info"]["cached_tokens"] == 0
    backed_up(a, backups)
    before = a.kvcr_pages("local_restore")
    a.flush_cache()
    warm = a.generate(ids, max_new_tokens=NEW_TOKENS)
    restored = a.kvcr_pages("local_restore") - before
    meta = warm["meta_info"]
    print(f"cached_tokens={meta['cached_tokens']} details={meta.get('cached_tokens_details')} kvcr_pages={restored}")
    assert meta["cached_tokens"] == REUSABLE
    assert meta["cached_tokens_details"]["storage"] == REUSABLE  # not the device or host tier: they were flushed
    assert restored == PAGES
    assert answer(warm) == answer(cold)


def test_corrupted_restore_changes_the_answer(servers):
    """The control: the same flow, but the restored pages are overwritten after kvcr is done."""
    a, c = servers["a"], servers["c"]
    ids = prompt_ids(PROMPT_TOKENS, seed=2)
    backups = c.kvcr_pages("backup")
    cold = c.generate(ids, max_new_tokens=NEW_TOKENS)
    assert answer(cold) == answer(a.generate(ids, max_new_tokens=NEW_TOKENS))  # same model, same answer
    backed_up(c, backups)
    before = c.kvcr_pages("local_restore")
    c.flush_cache()
    warm = c.generate(ids, max_new_tokens=NEW_TOKENS)
    assert warm["meta_info"]["cached_tokens"] == REUSABLE
    assert c.kvcr_pages("local_restore") - before == PAGES
    tokens, logprobs = answer(warm)
    print(f"cold {answer(cold)}\ncorrupt {tokens} {logprobs}")
    assert (tokens, logprobs) != answer(cold)


def test_peer_restore_over_nixl_with_a_hint(servers):
    a, b = servers["a"], servers["b"]
    ids = prompt_ids(PROMPT_TOKENS, seed=3)
    backups = a.kvcr_pages("backup")
    on_a = a.generate(ids, max_new_tokens=NEW_TOKENS)
    backed_up(a, backups)
    served_before = a.kvcr_pages("served")
    remote_before = b.kvcr_pages("remote_restore")
    on_b = b.generate(ids, max_new_tokens=NEW_TOKENS, kv_hints=fetch_hint(a, ids))
    remote = b.kvcr_pages("remote_restore") - remote_before
    meta_a, meta_b = on_a["meta_info"], on_b["meta_info"]
    prefill_a = meta_a["prompt_tokens"] - meta_a["cached_tokens"]
    prefill_b = meta_b["prompt_tokens"] - meta_b["cached_tokens"]
    print(f"B: cached_tokens={meta_b['cached_tokens']} remote pages={remote} prefill {prefill_a} -> {prefill_b}")
    assert remote == PAGES
    assert a.kvcr_pages("served") - served_before == remote
    assert meta_b["cached_tokens_details"]["storage"] == REUSABLE
    assert prefill_a - prefill_b == REUSABLE
    assert answer(on_b) == answer(on_a)


def test_unhinted_replica_recomputes(servers):
    """Without a hint B has nothing for a prompt only A served: it recomputes, and agrees."""
    a, b = servers["a"], servers["b"]
    ids = prompt_ids(PROMPT_TOKENS, seed=4)
    on_a = a.generate(ids, max_new_tokens=NEW_TOKENS)
    remote_before = b.kvcr_pages("remote_restore")
    on_b = b.generate(ids, max_new_tokens=NEW_TOKENS)
    assert on_b["meta_info"]["cached_tokens"] == 0
    assert b.kvcr_pages("remote_restore") == remote_before
    assert answer(on_b) == answer(on_a)


@pytest.mark.parametrize("fault", ["frozen", "killed"])  # killed last: A is gone for the rest of the module
def test_faulty_source_costs_a_recompute_never_a_wrong_token(servers, fault):
    a, b = servers["a"], servers["b"]
    prompts = [prompt_ids(PROMPT_TOKENS, seed=10 + i + (5 if fault == "killed" else 0)) for i in range(3)]
    backups = a.kvcr_pages("backup")
    expected = [answer(a.generate(ids, max_new_tokens=NEW_TOKENS)) for ids in prompts]
    hints = [fetch_hint(a, ids) for ids in prompts]
    backed_up(a, backups, 3 * PAGES)  # A really holds what the hints name
    if fault == "frozen":
        a.signal(signal.SIGSTOP)
        assert wait_until_stopped(a.proc.pid)
    else:
        a.signal(signal.SIGKILL)
        a.proc.wait(10)
    try:
        remote_before = b.kvcr_pages("remote_restore")
        for ids, hint, want in zip(prompts, hints, expected, strict=True):
            started = time.monotonic()
            reply = b.generate(ids, max_new_tokens=NEW_TOKENS, kv_hints=hint, timeout_s=30.0)
            took = time.monotonic() - started
            print(f"{fault}: answered in {took:.2f} s, cached_tokens={reply['meta_info']['cached_tokens']}")
            assert reply["meta_info"]["cached_tokens"] == 0  # nothing came from A
            assert answer(reply) == want
            # B's own bounds: a 250 ms control round trip, then the peer is skipped; the rest is prefill and
            # this shared 2-core machine. A hung restore would wait out prefetch_timeout_base (15 s) and more.
            assert took < 12.0
        assert b.kvcr_pages("remote_restore") == remote_before
    finally:
        if fault == "frozen":
            a.signal(signal.SIGCONT)
