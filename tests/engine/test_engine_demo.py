"""``kvcr demo``: the README's demo on real engines (``--engine sglang``, the default), as an operator runs it.

Two ``python -m dynamo.sglang`` workers behind Dynamo's frontend and KV router, four conversations
of three turns, other users' prompts pushing the conversations out of the engines' GPU and host
pools before the last round; the command's exit status is 0 only when every turn was answered,
every answer equals the one a SGLang server with no cache computes, and pages came back both from
a worker's own kvcr DRAM and from a peer's kvcr on the router's hint.
"""

from __future__ import annotations

import re

import pytest

from kvcr.cli import main

pytestmark = [pytest.mark.timeout(420)]


def test_the_demo_on_real_engines_reuses_the_prefix_and_answers_as_without_reuse(tmp_path, capsys):
    status = main(["demo", "--quiet", "--workdir", str(tmp_path)])  # --engine sglang is the default
    out = capsys.readouterr().out  # --quiet keeps the table and the verdict
    assert status == 0, out[-4000:]
    assert re.search(r"turns \(answered / sent\)\s*│\s*12 / 12", out), out
    assert re.search(r"answers equal to the answer without reuse\s*│\s*12 / 12", out), out
    saved = int(re.search(r"prefill tokens saved \(SGLang's cached_tokens\)\s*│\s*(\d+)", out).group(1))
    peer = int(re.search(r"pages restored from a peer \(router's hint\)\s*│\s*(\d+)", out).group(1))
    local = int(re.search(r"pages restored from local kvcr DRAM\s*│\s*(\d+)", out).group(1))
    assert saved > 0 and peer > 0 and local > 0, out
    assert re.search(r"other users' prompts \(GPU and host pools flushed\)\s*│\s*16", out), out
    # the real model answers in words: the table quotes the start of conversation 0's answers
    assert re.search(r"What does the assert statement do\?\s*│\s*[A-Z][a-z]+ [a-z]+", out), out
    print(f"saved {saved} prefill tokens, {local} pages from local kvcr DRAM, {peer} pages from a peer")
