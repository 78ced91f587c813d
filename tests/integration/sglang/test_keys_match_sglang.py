"""kvcr's page keys are bit-exact with SGLang's own (native) page hash, in every supported release."""

import random

import pytest
from sglang.srt.mem_cache.utils import get_hash_str, hash_str_to_int64, storage_namespace_seed

from kvcr.domain.keys import namespace_seed, page_hashes, router_id_signed
from tests.integration.sglang import sg


@pytest.mark.parametrize("page_size", [1, 4, 16, 64])
def test_chained_page_hashes_match(page_size):
    rng = random.Random(page_size)
    tokens = [rng.randrange(0, 152_000) for _ in range(page_size * 9)]
    assert page_hashes(tokens, page_size) == get_hash_str(tokens, None, page_size=page_size)
    prior = get_hash_str(tokens[:page_size], None, page_size=page_size)[0]
    assert page_hashes(tokens[page_size:], page_size, prior) == get_hash_str(tokens[page_size:], prior, page_size)


def test_wide_token_pages_match():
    tokens = [1, 2, (1 << 31) + 3, 4, 5, 6, 7, 8]  # the widest ids every supported SGLang hashes
    assert page_hashes(tokens, 4) == get_hash_str(tokens, None, page_size=4)
    wide = [1, 2, (1 << 40) + 3, 4, 5, 6, 7, 8]
    if sg.hashes_wide_token_ids():
        assert page_hashes(wide, 4) == get_hash_str(wide, None, page_size=4)
    else:  # 0.5.22 refuses such an id, so no page of it ever reaches storage
        with pytest.raises(OverflowError):
            get_hash_str(wide, None, page_size=4)


@pytest.mark.parametrize(("extra_key", "salt"), [(None, None), ("lora-a", None), (None, "tenant"), ("k", "ü-salt")])
def test_namespace_seed_matches(extra_key, salt):
    assert namespace_seed(extra_key, salt) == storage_namespace_seed(extra_key, salt)
    seed = namespace_seed(extra_key, salt)
    tokens = list(range(32))
    assert page_hashes(tokens, 16, seed) == get_hash_str(tokens, seed, page_size=16)


def test_router_identity_matches_the_event_hash():
    for h in get_hash_str(list(range(160)), None, page_size=16):
        assert router_id_signed(h) == hash_str_to_int64(h)
