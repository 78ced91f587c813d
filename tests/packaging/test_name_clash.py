"""The import-name clash with NVIDIA's KV Cache Runner, installed for real into a throwaway venv.

NVIDIA's PyPI distribution ``kvcr`` installs an import package ``kvcr`` (``kvcr/__init__.py``,
``kvcr/api.py``, ...; a RECORD and no top_level.txt). A stand-in wheel with that shape is built
here, kvcr-runner's own wheel is built from a copy of this checkout, and pip installs both, in
either order, into a fresh venv; ``python -m kvcr.compat`` there must name the other distribution.
"""

import base64
import hashlib
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.packaging

REPO = Path(__file__).resolve().parents[2]
PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]


def record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def fake_nvidia_kvcr(out: Path) -> Path:
    """A wheel named kvcr 0.1.1 whose files overlap ours at kvcr/__init__.py."""
    info = "kvcr-0.1.1.dist-info"
    files = {
        "kvcr/__init__.py": b'"""Stand-in for NVIDIA\'s KV Cache Runner."""\n__version__ = "0.1.1"\n',
        "kvcr/api.py": b"def start():\n    return 'nvidia'\n",
        f"{info}/METADATA": b"Metadata-Version: 2.1\nName: kvcr\nVersion: 0.1.1\nSummary: stand-in\n",
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: kvcr-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = [record_line(n, d) for n, d in files.items()] + [f"{info}/RECORD,,"]
    path = out / "kvcr-0.1.1-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as whl:
        for name, data in files.items():
            whl.writestr(name, data)
        whl.writestr(f"{info}/RECORD", "\n".join(record) + "\n")
    return path


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("wheels")
    src = tmp_path_factory.mktemp("src") / "kvcr-runner"
    src.mkdir()
    # a copy, so that setuptools' build/ and egg-info never land in (or come from) the checkout
    shutil.copytree(REPO / "kvcr", src / "kvcr", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    subprocess.run(
        [*PIP, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(src)],
        check=True,
        timeout=240,
    )
    (ours,) = out.glob("kvcr_runner-*.whl")
    return {"ours": ours, "nvidia": fake_nvidia_kvcr(out)}


def fresh_venv(root: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    return root / "bin" / "python"


def install(python: Path, wheel: Path) -> None:
    subprocess.run([*PIP, "--python", str(python), "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True)


def compat_lines(python: Path, cwd: Path) -> tuple[int, list[str]]:
    done = subprocess.run(
        [str(python), "-I", "-m", "kvcr.compat"], cwd=cwd, capture_output=True, text=True, timeout=120
    )
    assert not done.stderr, done.stderr
    return done.returncode, done.stdout.splitlines()


def clash_line(lines: list[str]) -> str:
    (line,) = [line for line in lines if "import package 'kvcr'" in line]
    return line


def test_kvcr_runner_alone_is_not_a_clash(wheels, tmp_path):
    python = fresh_venv(tmp_path / "venv")
    install(python, wheels["ours"])
    _, lines = compat_lines(python, tmp_path)
    assert lines[0] == "kvcr: only kvcr-runner installs 'kvcr'"


def test_nvidias_kvcr_installed_after_ours_is_named_and_its_init_detected(wheels, tmp_path):
    python = fresh_venv(tmp_path / "venv")
    install(python, wheels["ours"])
    install(python, wheels["nvidia"])  # pip overwrites our kvcr/__init__.py without a word
    rc, lines = compat_lines(python, tmp_path)
    line = clash_line(lines)
    assert rc == 1
    assert "also installed by kvcr 0.1.1" in line
    assert "kvcr/__init__.py is not kvcr-runner's" in line
    assert "separate environments" in line


def test_ours_installed_after_nvidias_is_still_a_clash(wheels, tmp_path):
    python = fresh_venv(tmp_path / "venv")
    install(python, wheels["nvidia"])
    install(python, wheels["ours"])  # now ours overwrote theirs; uninstalling theirs would delete it
    rc, lines = compat_lines(python, tmp_path)
    line = clash_line(lines)
    assert rc == 1
    assert "also installed by kvcr 0.1.1" in line
    assert "is not kvcr-runner's" not in line
