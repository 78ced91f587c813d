"""kvcr under SGLang 0.5.23's real scheduler: real servers, a real model, real HTTP requests.

Two servers start once for the module (in parallel, ~1.5-2.5 minutes on a shared 2-core machine):

* A and B: kvcr as L3 over NIXL on loopback; B follows hints (``enable_remote_hint``), and its L3
  reads start ``READ_DELAY_S`` after its hit query (``KVCR_ENGINE_READ_DELAY_S``), so a test can
  freeze or kill A while B restores.
* A carries the harness's corruption control (``KVCR_ENGINE_CORRUPT_FLAG``): while the test's flag
  file exists, the pages kvcr restores are overwritten in SGLang's host pool after kvcr is done, so
  the equality checks below are shown able to fail.

Every request is greedy with logprobs. ``cached_tokens`` is SGLang's own count of prompt tokens it
did not compute; ``kvcr_pages_total`` is kvcr's counter on SGLang's ``/metrics``.
"""

import signal
import threading
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
READ_DELAY_S = 1.5  # B's L3 reads start this late (the harness's control): the window to fault A in


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine")
    model = write_model(root / "model", seed=7)
    a = EngineServer(model, root / "a.log", env={"KVCR_ENGINE_CORRUPT_FLAG": str(root / "corrupt-a")})
    b = EngineServer(
        model,
        root / "b.log",
        kvcr_settings={"enable_remote_hint": True, "operation_timeout_ms": 2000},
        env={"KVCR_ENGINE_READ_DELAY_S": str(READ_DELAY_S)},
    )
    started = time.monotonic()
    start_all([a, b])
    print(f"two servers up in {time.monotonic() - started:.1f} s")
    yield {"a": a, "b": b, "corrupt_a": root / "corrupt-a"}
    stop_all([a, b])


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
    """The control: the same flow with the restored pages overwritten after kvcr is done, then without."""
    a, flag = servers["a"], servers["corrupt_a"]
    ids = prompt_ids(PROMPT_TOKENS, seed=2)
    backups = a.kvcr_pages("backup")
    cold = a.generate(ids, max_new_tokens=NEW_TOKENS)
    backed_up(a, backups)
    before = a.kvcr_pages("local_restore")
    a.flush_cache()
    flag.touch()
    try:
        corrupt = a.generate(ids, max_new_tokens=NEW_TOKENS)
    finally:
        flag.unlink()
        a.flush_cache()  # the corrupted pages leave the device and host tiers; kvcr DRAM never saw them
    assert corrupt["meta_info"]["cached_tokens"] == REUSABLE
    assert a.kvcr_pages("local_restore") - before == PAGES
    print(f"cold {answer(cold)}\ncorrupt {answer(corrupt)}")
    assert answer(corrupt) != answer(cold)
    again = a.generate(ids, max_new_tokens=NEW_TOKENS)  # the same restore, nothing overwritten
    assert again["meta_info"]["cached_tokens"] == REUSABLE
    assert answer(again) == answer(cold)


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


def timed(server, ids, **kwargs):
    started = time.monotonic()
    reply = server.generate(ids, max_new_tokens=NEW_TOKENS, timeout_s=60.0, **kwargs)
    return reply, time.monotonic() - started


@pytest.mark.parametrize("fault", ["frozen", "killed"])  # killed last: A is gone for the rest of the module
def test_source_fault_while_b_restores_costs_a_recompute_never_a_wrong_token(servers, fault):
    """A is frozen or killed between B's lease (at B's hit query) and B's read, then stays so for two more."""
    a, b = servers["a"], servers["b"]
    prompts = [prompt_ids(PROMPT_TOKENS, seed=(10 if fault == "frozen" else 20) + i) for i in range(3)]
    backups = a.kvcr_pages("backup")
    expected = [answer(a.generate(ids, max_new_tokens=NEW_TOKENS)) for ids in prompts]
    backed_up(a, backups, 3 * PAGES)  # A really holds what the hints name
    remote_before = b.kvcr_pages("remote_restore")
    first: dict = {}

    def restore_while_faulted():
        try:
            first["reply"], first["took"] = timed(b, prompts[0], kv_hints=fetch_hint(a, prompts[0]))
        except Exception as exc:  # reported by the assertion below
            first["error"] = exc

    during = threading.Thread(target=restore_while_faulted)
    during.start()
    # B's hit query leased A's pages; its read waits READ_DELAY_S (the harness's control), A faults now.
    wait_for(lambda: a.metric("kvcr_leases_held", role="source") > 0, 30.0, "A granting B a lease")
    if fault == "frozen":
        a.signal(signal.SIGSTOP)
        assert wait_until_stopped(a.proc.pid)
    else:
        a.signal(signal.SIGKILL)
        a.proc.wait(10)
    try:
        during.join(60.0)
        assert not during.is_alive() and "error" not in first, first
        replies = [(first["reply"], first["took"])]
        replies += [timed(b, ids, kv_hints=fetch_hint(a, ids)) for ids in prompts[1:]]
        remote = b.kvcr_pages("remote_restore") - remote_before
        for (reply, took), want in zip(replies, expected, strict=True):
            print(f"{fault}: answered in {took:.2f} s, cached_tokens={reply['meta_info']['cached_tokens']}")
            assert answer(reply) == want
        print(f"{fault}: pages B restored from A: {remote}")
        # During: B's read waits READ_DELAY_S, then at most operation_timeout_ms (2 s) before it is a miss;
        # the rest is the prefill on this shared 2-core machine.
        assert replies[0][1] < READ_DELAY_S + 2.0 + 10.0
        assert remote in (0, PAGES)  # a frozen A's DRAM may still be readable; never part of a prefix
        assert replies[0][0]["meta_info"]["cached_tokens"] == remote * PAGE_SIZE
        for reply, took in replies[1:]:  # A faulty before the hit query: a 250 ms control deadline, then skipped
            assert reply["meta_info"]["cached_tokens"] == 0
            assert took < 12.0
    finally:
        if fault == "frozen":
            a.signal(signal.SIGCONT)
