"""Generated extra-config dicts and token files: a valid settings object or one ConfigError line naming a key.

``parse_settings`` sees dicts whose keys are kvcr's, SGLang's, misspelt or not strings at all,
with values of every type and size (what ``json.loads`` of an operator's flag can produce,
``NaN`` and ``Infinity`` included, plus what a Python caller could pass). ``read_token_file``
sees regular files of every mode and content, symlinks, directories, FIFOs, sockets, devices,
and paths that are missing, too long, or not encodable. Anything but ``ConfigError`` is a bug;
so is a ``ConfigError`` of more than one line or naming nothing, and so is a settings object
that later fails (its timing, its numbers, its token).
"""

import math
import os
import socket
import stat
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvcr.domain.errors import ConfigError
from kvcr.integrations.shared.settings import (
    _TYPES,
    MAX_TOKEN_BYTES,
    MIN_TOKEN_BYTES,
    MIN_TOKEN_DISTINCT_BYTES,
    SGLANG_KEYS,
    KvcrSettings,
    parse_settings,
    read_token_file,
)
from tests.fuzz.budget import budget, count
from tests.fuzz.strategies import edge_ints

KNOWN = sorted([*_TYPES, "dram_bytes"])
NAMES = (*KNOWN, *sorted(SGLANG_KEYS))

weird_text = st.one_of(
    st.sampled_from(
        [
            "",
            " ",
            "\x00",
            "nixl",
            "mock",
            "lru",
            "auto",
            "staged",
            "direct",
            "127.0.0.1",
            "0.0.0.0",
            "::1",
            "*",
            "8GiB",
            "8 GiB",
            "1.5KiB",
            "0.5b",
            "1e9",
            "0x10",
            "-1",
            "9" * 40,
            "\u0661\u0662",
            "tcp://127.0.0.1:5557",
            "tcp://*:5557",
            "tcp://[::]:1",
            "ipc:///tmp/x",
            "/dev/null",
            "/nonexistent/token",
            "10.0.0.0/8",
            "10.0.0.0/33",
            "fe80::1%eth0",
            "NaN",
            "inf",
        ]
    ),
    st.text(max_size=40),
    st.builds(
        lambda c, n: c * n, st.sampled_from(["a", "\n", "\x00", "9", "\U0001f600"]), st.sampled_from([1000, 100_000])
    ),
)
numbers = st.one_of(
    edge_ints,
    st.integers(-(10**6), 10**6),
    st.sampled_from([10**18, 10**400, -(10**400), 2**63, 86_400_000, 3_600_000]),
    st.builds(pow, st.sampled_from([10, -10]), st.just(5000)),  # past str()'s 4300 digits (hypothesis can't repr it)
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([float("nan"), float("inf"), float("-inf"), -0.0, 1e308, 5e-324]),
)
values = st.recursive(
    st.one_of(st.none(), st.booleans(), numbers, weird_text),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=3)),
    max_leaves=8,
)
keys = st.one_of(st.sampled_from(NAMES), st.sampled_from(NAMES).map(str.upper), st.text(max_size=20), edge_ints)
# Values of about the right type for each known key, so a case gets past the type checks to the range
# and cross-field rules (a purely random dict mostly stops at its first wrong type).
_ABOUT_RIGHT = {
    int: numbers,
    float: numbers,
    str: weird_text,
    bool: st.booleans(),
    type(None): st.none(),
    list: st.lists(weird_text, max_size=3),
}


def _about_right(key: str) -> st.SearchStrategy:
    kinds = _TYPES.get(key, (int, str))
    return st.one_of(*(_ABOUT_RIGHT[k] for k in kinds), values)


typed_configs = st.lists(st.sampled_from(KNOWN), unique=True, max_size=6).flatmap(
    lambda names: st.fixed_dictionaries({name: _about_right(name) for name in names})
)
single_key_configs = st.sampled_from(KNOWN).flatmap(lambda name: st.fixed_dictionaries({name: _about_right(name)}))
extra_configs = st.one_of(st.dictionaries(keys, values, max_size=8), typed_configs, single_key_configs)


def _names_a_key(message: str, config: dict) -> bool:
    named = {str(k) for k in config} | {repr(k) for k in config} | set(KNOWN)
    return any(name and name in message for name in named)


def _check_valid(settings: KvcrSettings) -> None:
    """A valid settings object keeps working: its timing builds, its numbers are finite, its token reads or fails."""
    settings.timing()
    for name in KvcrSettings.__slots__:
        value = getattr(settings, name)
        if isinstance(value, float):
            assert math.isfinite(value), f"{name} = {value} was accepted"
    try:
        settings.token()
        settings.rotation_tokens()
    except ConfigError as exc:
        assert "\n" not in str(exc)
    for host in ("127.0.0.1", "10.1.2.3", "::1", "[::1]", "example", "", "\x00"):
        assert isinstance(settings.allows(host), bool)


def test_generated_extra_configs_give_settings_or_one_line_naming_a_key():
    @budget("settings.dicts")
    @given(extra_configs)
    def case(config):
        count("settings.dicts")
        try:
            settings = parse_settings(config)
        except ConfigError as exc:
            message = str(exc)
            assert message and "\n" not in message and "\r" not in message, repr(message[:200])
            assert _names_a_key(message, config), message[:300]
            return
        _check_valid(settings)

    case()


START_BYTES = 16 << 20  # a generated config is also started when its arena is at most this big


@pytest.mark.sglang
def test_generated_extra_configs_through_the_backend_constructor_and_start_up(tmp_path):
    """The operator's path: SGLang constructs the backend from the extra config, then registers the pools."""
    from kvcr.testing.sglang import prepare_environment

    prepare_environment()
    from sglang.srt.runtime_context import get_parallel

    from kvcr.integrations.sglang import KvcrHiCacheStorage
    from tests.integration.sglang import sg

    get_parallel().override_permanently(attn_dcp_size=1, attn_dcp_rank=0, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)
    host = sg.mha_host("page_first")

    @budget("settings.backend")
    @given(typed_configs)
    def case(generated):
        count("settings.backend")
        config = sg.storage_config()
        config.extra_config.update(generated)
        config.extra_config.pop("kv_events_endpoint", None)  # would bind a real port
        store = None
        try:
            store = KvcrHiCacheStorage(config, {})
            if store.settings.dram_bytes <= START_BYTES:
                store.register_mem_pool_host(host)
                store.register_mem_host_pool_v2(host, "kv")
                store.on_host_pools_registered()
        except ConfigError as exc:
            message = str(exc)
            assert message and "\n" not in message, repr(message[:200])
            assert _names_a_key(message, config.extra_config) or "interface_v1" in message, message[:300]
        finally:
            if store is not None:
                store.close()

    case()


# ------------------------------------------------------------------ token files

contents = st.one_of(
    st.binary(max_size=64),
    st.builds(
        lambda n, b: b * n,
        st.sampled_from([MIN_TOKEN_BYTES - 1, MIN_TOKEN_BYTES, MAX_TOKEN_BYTES, MAX_TOKEN_BYTES + 1]),
        st.sampled_from([b"k", b" ", b"\x00", b"\n"]),
    ),
    st.builds(
        lambda t, pad: pad + t + pad, st.binary(min_size=16, max_size=40), st.sampled_from([b"", b"\n", b" \t\r\n"])
    ),
)
modes = st.one_of(
    st.sampled_from([0o600, 0o400, 0o644, 0o640, 0o604, 0o000, 0o700, 0o602, 0o620, 0o777]), st.integers(0, 0o777)
)
token_files = st.one_of(
    st.tuples(st.just("regular"), contents, modes),
    st.tuples(st.just("symlink"), contents, modes),
    st.tuples(
        st.sampled_from(
            [
                "dangling",
                "directory",
                "fifo",
                "socket",
                "dev_zero",
                "dev_null",
                "missing",
                "empty_path",
                "nul_in_path",
                "surrogate",
                "escaped_bytes",
                "too_long",
                "dir_component",
            ]
        ),
        st.just(b""),
        st.just(0),
    ),
)


def _make(tmp_path, kind, data, mode, serial):
    """Create the file system object; returns its path (a str, as the setting holds it)."""
    base = tmp_path / f"t{serial}"
    if kind in ("regular", "symlink"):
        target = base.with_suffix(".real")
        target.write_bytes(data)
        os.chmod(target, mode)
        if kind == "regular":
            return str(target)
        base.symlink_to(target)
        return str(base)
    if kind == "dangling":
        base.symlink_to(tmp_path / "nowhere")
    elif kind == "directory":
        base.mkdir(mode=0o700)
    elif kind == "fifo":
        os.mkfifo(base, 0o600)
    elif kind == "socket":
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(base))
        sock.close()
        os.chmod(base, 0o600)
    elif kind == "dev_zero":
        base.symlink_to("/dev/zero")
    elif kind == "dev_null":
        return "/dev/null"
    elif kind == "missing":
        pass
    elif kind == "empty_path":
        return ""
    elif kind == "nul_in_path":
        return str(base) + "\x00tail"
    elif kind == "surrogate":
        return str(base) + "\ud800"
    elif kind == "escaped_bytes":  # a path that is not UTF-8 on disk, as Python spells it
        name = os.fsdecode(os.fsencode(str(base)) + b"\xff")
        with open(name, "wb") as handle:
            handle.write(b"x" * 32)
        os.chmod(name, 0o600)
        return name
    elif kind == "too_long":
        return str(base) + "/" + "n" * 5000
    elif kind == "dir_component":
        base.write_bytes(b"x" * 32)
        return str(base / "token")
    return str(base)


def _read_bounded(path):
    """read_token_file in a thread: a FIFO or device that blocks start-up is a failure, not a hang of the suite."""
    outcome = {}

    def run():
        try:
            outcome["token"] = read_token_file(path)
        except BaseException as exc:
            outcome["error"] = exc

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(5)
    if worker.is_alive():
        if stat.S_ISFIFO(os.stat(path).st_mode):  # a writer unblocks the reader's open()
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            os.close(fd)
        worker.join(5)
        raise AssertionError(f"read_token_file({path!r}) blocked")
    return outcome


def test_token_files_of_every_kind_give_a_token_or_one_line_naming_the_setting(tmp_path):
    serial = iter(range(10**9))

    @budget("settings.token_files")
    @given(token_files)
    def case(spec):
        count("settings.token_files")
        kind, data, mode = spec
        path = _make(tmp_path, kind, data, mode, next(serial))
        outcome = _read_bounded(path)
        if "error" in outcome:
            exc = outcome["error"]
            assert isinstance(exc, ConfigError), f"{type(exc).__name__}: {exc}"
            assert "\n" not in str(exc) and "auth_token_file" in str(exc), str(exc)
            accept = False
        else:
            accept = True
        if kind in ("regular", "symlink"):
            token = data.strip()
            valid = (
                not mode & 0o077
                and len(token) >= MIN_TOKEN_BYTES
                and len(data) <= MAX_TOKEN_BYTES
                and b"\x00" not in token
                and len(set(token)) >= MIN_TOKEN_DISTINCT_BYTES
            )
            assert accept == valid, (kind, mode, len(data), outcome)
            if accept:
                assert outcome["token"] == token
        elif kind != "escaped_bytes":
            assert not accept, (kind, outcome)

    case()


@pytest.mark.parametrize("kind", ["fifo", "dev_zero"])
def test_through_parse_settings_a_special_file_never_blocks(tmp_path, kind):
    path = _make(tmp_path, kind, b"", 0, 0)
    settings = parse_settings({"auth_token_file": path})
    with pytest.raises(ConfigError, match="auth_token_file"):
        settings.token()
