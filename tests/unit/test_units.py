import pytest

from kvcr.domain.errors import ConfigError
from kvcr.domain.units import format_byte_size, parse_byte_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [("8GiB", 8 << 30), ("512MiB", 512 << 20), ("1.5KiB", 1536), ("2GB", 2_000_000_000), ("4096", 4096), (7, 7)],
)
def test_parse_byte_size(text, expected):
    assert parse_byte_size(text) == expected


@pytest.mark.parametrize("bad", ["8XB", "lots", "-1", "1.3B", True, -5, 1.5])
def test_bad_sizes_name_the_setting(bad):
    with pytest.raises(ConfigError, match="dram_bytes"):
        parse_byte_size(bad, name="dram_bytes")


def test_format_byte_size():
    assert format_byte_size(2 << 20) == "2MiB"
    assert format_byte_size(1000) == "1000B"
