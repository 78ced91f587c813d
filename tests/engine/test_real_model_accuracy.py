"""The accuracy probe on a real trained model (SmolLM2-135M-Instruct) under real SGLang servers.

Four servers (``kvcr.testing.real_fleet``: a NIXL pair, a pair on kvcr's default transport) start
once for the module; the model is converted on first use into the repo's ignored cache
(``kvcr.testing.real_model``). At 1,024 and 2,048 tokens of real English, greedy answers with
logprobs from scratch are compared with the same prompt restored from local kvcr DRAM, from a peer
over NIXL and from a same-host peer over the default transport, within the bound
``kvcr.bench.accuracy`` derives from the measured noise; the control corrupts one restored page and
the same check must catch it. ``kvcr bench accuracy`` runs the same probe up to 8,160 tokens.
"""

import os
import time
from pathlib import Path

import pytest

from kvcr.bench.accuracy import FLOOR, NEW_TOKENS, accuracy_table, control, judge
from kvcr.testing.real_fleet import RESTORED, RealFleet
from kvcr.testing.real_model import decode, document_prompt, real_model

LENGTHS = (1024, 2048)
pytestmark = [pytest.mark.timeout(600)]  # the first test also converts the model (once) and starts four servers


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    model = real_model()
    with RealFleet(model, tmp_path_factory.mktemp("real"), max_prompt_tokens=max(LENGTHS)) as fleet:
        yield model, fleet


@pytest.fixture(scope="module")
def results(fleet):
    model, servers = fleet
    return [
        judge(length, servers.paths(document_prompt(model, length, seed=700 + i), NEW_TOKENS))
        for i, length in enumerate(LENGTHS)
    ]


@pytest.mark.parametrize("index", range(len(LENGTHS)), ids=[f"{n}-tokens" for n in LENGTHS])
def test_every_restore_answers_as_from_scratch(results, index):
    result = results[index]
    print(f"{result.prompt_tokens} tokens: {result.answer!r} gaps={result.gaps} bound={result.bound}")
    assert result.answer.strip(), "the model answered nothing"
    reusable = (result.prompt_tokens - 1) // 16 * 16
    for path in RESTORED:
        assert result.storage_tokens[path] == reusable, f"{path} did not read the prefix from kvcr"
        assert result.same_tokens[path], f"{path}'s greedy answer differs from scratch"
        assert result.gaps[path] <= result.bound, f"{path}'s logprobs differ by {result.gaps[path]} > {result.bound}"
    assert result.ok


def test_the_answer_is_readable_english(fleet, results):
    """A trained model, not random weights: the answer is words the documentation prompt asked for."""
    model, _ = fleet
    words = results[0].answer.split()
    assert len(words) >= 4 and sum(w.isalpha() for w in words) >= len(words) // 2, results[0].answer
    assert decode(model, document_prompt(model, 300, seed=1)[-12:]).strip().endswith("assistant")


def test_one_corrupted_page_is_caught(fleet, results):
    model, servers = fleet
    bound = max(max(r.bound for r in results), FLOOR)
    check = control(servers, model, LENGTHS[0], bound, NEW_TOKENS)
    print(accuracy_table(results, check))
    assert check.caught, f"one corrupted page went unnoticed (gap {check.gap}, same tokens {check.same_tokens})"
    assert check.gap > 100 * bound  # far outside the noise, not at its edge


def _group_cpu_seconds(pgid):
    """CPU seconds (user + system) of every thread of every process in process group ``pgid``."""
    total = 0.0
    for stat in Path("/proc").glob("[0-9]*/task/[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue  # a thread that ended while the scan ran
        fields = text[text.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid:
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def test_idle_servers_leave_the_cpu_alone(fleet, results):
    """An idle SGLang scheduler on the CPU polled without pause and held a core each (--sleep-on-idle fixed it)."""
    _, servers = fleet
    pgids = [server.proc.pid for server in servers.servers.values()]
    before = [_group_cpu_seconds(pgid) for pgid in pgids]
    time.sleep(3.0)
    used = [_group_cpu_seconds(pgid) - b for pgid, b in zip(pgids, before, strict=True)]
    print(f"CPU seconds of four idle servers over 3 s: {used}")
    assert max(used) < 1.5, used  # a spinning scheduler alone uses 3.0
