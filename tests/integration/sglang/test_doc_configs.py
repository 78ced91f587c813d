"""Each extra-config the docs show starts kvcr on SGLang's real host pool, in the layout its command names.

The doc's values that only fit the doc's host (32 GiB of DRAM, a 10.0.0.x address, a token under
/etc) are replaced by ones this machine has; every other key is the doc's, so a key the backend
reads differently from what the doc says (a mistyped value, a layout kvcr cannot serve) fails here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvcr.testing.docs import fill_placeholders, option
from tests.integration.sglang import sg
from tests.unit.test_docs import PLACEHOLDERS, extra_configs

pytestmark = pytest.mark.nixl

LOCAL = {"dram_bytes": "64MiB", "control_host": "127.0.0.1", "control_advertise_host": None}


@pytest.mark.parametrize(("command", "config"), extra_configs(), ids=lambda c: getattr(c, "where", "config"))
def test_a_doc_config_starts_kvcr_on_sglangs_host_pool_and_round_trips_a_page(command, config, tmp_path: Path):
    layout = option(command.words, "--hicache-mem-layout") or "page_first"
    settings = json.loads(fill_placeholders(config, PLACEHOLDERS))
    settings.update(LOCAL, control_port=sg.free_port())
    if "auth_token_file" in settings:
        token = tmp_path / "token"
        token.write_bytes(bytes(range(40, 104)))
        token.chmod(0o600)
        settings["auth_token_file"] = str(token)
    settings = {key: value for key, value in settings.items() if value is not None}
    host = sg.mha_host(layout)
    config_object = sg.storage_config()
    config_object.extra_config = settings
    store = sg.backend(host, config_object)
    try:
        keys = sg.hashes(2)
        src = host.alloc(2 * sg.P)
        sg.fill(host, src, seed=7)
        assert store.batch_set_v1(keys, src) == [True, True], command.where
        dst = host.alloc(2 * sg.P)
        assert store.batch_get_v1(keys, dst) == [True, True], command.where
        assert sg.pages_equal(host, src, host, dst)
    finally:
        store.close()
