"""The wheelhouse for a GPU host without network (scripts/wheelhouse.py, scripts/install_wheelhouse.py): parts of
at most the limit, checked and joined back byte-exact, every damage named; and the closure that leaves out torch
and what only torch needs, following the extras a dependency asks for."""

import json
import subprocess
import sys

import pytest

from scripts.wheelhouse import needed
from scripts.wheelhouse_parts import MANIFEST, PartsError, pack, reassemble, sha256_of
from tests.conftest import REPO


@pytest.fixture
def house(tmp_path):
    """Three files of 0.25 MB of random bytes (tar adds headers), packed in parts of at most 100,000 bytes."""
    import random

    src = tmp_path / "src"
    (src / "wheels").mkdir(parents=True)
    rng = random.Random(0)
    for name in ("a-1.0-py3-none-any.whl", "b-2.0-py3-none-any.whl", "c-3.0-py3-none-any.whl"):
        (src / "wheels" / name).write_bytes(rng.randbytes(250_000))
    record = pack(src, tmp_path / "parts", "house.tar", dict(python="3.12"), part_bytes=100_000)
    return src, tmp_path / "parts", record


def test_parts_are_at_most_the_limit_and_join_back_byte_exact(house, tmp_path):
    src, parts, record = house
    sizes = [p["bytes"] for p in record["parts"]]
    assert len(sizes) == -(-record["archive"]["bytes"] // 100_000) == 8 and max(sizes) == 100_000
    assert sum(sizes) == record["archive"]["bytes"] and not (parts / "house.tar").exists()
    assert json.loads((parts / MANIFEST).read_text())["python"] == "3.12"
    reassemble(parts, tmp_path / "out")
    for f in (src / "wheels").iterdir():
        assert sha256_of(tmp_path / "out" / "wheels" / f.name) == sha256_of(f)


@pytest.mark.parametrize(
    "damage,says",
    [
        ("flip", "part house.tar.003 does not match its sha256"),
        ("truncate", "part house.tar.003 has 99999 bytes, the manifest says 100000"),
        ("remove", "part house.tar.003 is missing"),
    ],
)
def test_a_damaged_or_missing_part_is_named(house, tmp_path, damage, says):
    _, parts, _ = house
    part = parts / "house.tar.003"
    data = part.read_bytes()
    if damage == "flip":
        part.write_bytes(data[:500] + bytes([data[500] ^ 1]) + data[501:])
    elif damage == "truncate":
        part.write_bytes(data[:-1])
    else:
        part.unlink()
    with pytest.raises(PartsError, match=says):
        reassemble(parts, tmp_path / "out")


def test_parts_of_another_wheelhouse_are_refused_as_a_whole(house, tmp_path):
    _, parts, record = house
    manifest = json.loads((parts / MANIFEST).read_text())
    manifest["archive"]["sha256"] = "0" * 64
    (parts / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(PartsError, match="different wheelhouses"):
        reassemble(parts, tmp_path / "out")


def test_an_archive_that_fills_its_last_part_exactly_leaves_no_empty_part(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "x").write_bytes(b"1" * 5_000)
    probe = pack(src, tmp_path / "probe", "h.tar", {}, part_bytes=10**9)["archive"]["bytes"]
    record = pack(src, tmp_path / "parts", "h.tar", {}, part_bytes=probe // 2)
    assert [p["bytes"] for p in record["parts"]] == [probe // 2] * 2 and probe % 2 == 0
    reassemble(tmp_path / "parts", tmp_path / "out")
    assert (tmp_path / "out" / "x").read_bytes() == b"1" * 5_000


def _item(name, requires=(), requested=False, extras=()):
    return dict(
        metadata=dict(name=name, version="1", requires_dist=list(requires)),
        requested=requested,
        requested_extras=list(extras),
    )


def test_the_closure_leaves_out_torch_and_what_only_it_needs_and_follows_extras():
    items = [
        _item("torchtitan", ["torch>=2", "torchdata"], requested=True),
        _item("torch", ["nvidia-cublas; platform_system == 'Linux'", "sympy", "filelock"], requested=True),
        _item("torchdata", ["torch>=2", "requests"]),
        _item("datasets", ["fsspec[http]>=2023", "filelock", "torch; extra == 'torch'"], requested=True),
        _item("fsspec", ["aiohttp; extra == 'http'", "s3fs; extra == 's3'"]),
        _item("math-verify", ["latex2sympy2_extended"], requested=True),
        _item("latex2sympy2-extended", ["sympy"]),
        _item("nvidia-cublas"),
        _item("sympy"),
        _item("filelock"),
        _item("requests"),
        _item("aiohttp"),
        _item("pywin32"),
        _item("x", ["pywin32; sys_platform == 'win32'"], requested=True),
    ]
    got = needed(items, "3.12", {"torch"})
    assert "torch" not in got and "nvidia-cublas" not in got  # only torch needs it
    assert {"sympy", "filelock", "aiohttp", "requests", "latex2sympy2-extended"} <= got  # others need them too
    assert "pywin32" not in got  # a marker false on Linux


def test_the_installer_refuses_a_wheelhouse_for_another_python_in_one_line(house):
    _, parts, _ = house
    manifest = json.loads((parts / MANIFEST).read_text())
    (parts / MANIFEST).write_text(json.dumps(dict(manifest, python="3.99", abi="cp399", wheels=[])))
    out = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "install_wheelhouse.py"), str(parts)], capture_output=True, text=True
    )
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert out.returncode == 1 and out.stderr.strip() == (
        f"install_wheelhouse: the wheelhouse is for Python 3.99 (cp399), this is Python {here}: run it with "
        f"python3.99, or make one with `make wheelhouse PYTHON_VERSION={here}`"
    )
