"""kvcr.testing.sglang's host-pool builders check what SGLang built; the bench and demo reach them."""

from types import SimpleNamespace

import pytest

from kvcr.domain.errors import KvcrError
from kvcr.testing.sglang import _exactly


def test_a_host_pool_sized_otherwise_than_asked_is_a_kvcr_error_naming_both_sizes():
    built = SimpleNamespace(size=3 * 64, page_size=64)
    with pytest.raises(KvcrError, match=r"192 tokens, not the 4 pages asked for"):
        _exactly(built, 4)


def test_a_host_pool_of_exactly_the_pages_asked_for_is_returned_as_built():
    built = SimpleNamespace(size=4 * 64, page_size=64)
    assert _exactly(built, 4) is built
