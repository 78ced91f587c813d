"""kvcr doctor's SGLang checks against the installed SGLang 0.5.23."""

from kvcr.doctor import Status, check_page_keys, check_sglang_version


def test_the_installed_sglang_is_the_one_kvcr_is_built_against():
    finding = check_sglang_version()
    assert finding.status is Status.OK and finding.detail == "sglang 0.5.23"


def test_kvcr_page_keys_equal_sglangs_own_hashes():
    finding = check_page_keys()
    assert finding.status is Status.OK, finding.detail
    assert "64-bit token ids" in finding.detail
