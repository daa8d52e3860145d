"""The embedded tiny VLM (forge_rl/models/build_tiny_vlm.py): its script rebuilds the shipped files bit for bit, and
it stays small enough to ship."""

from pathlib import Path

from forge_rl.models import resolve_model_path
from forge_rl.models.build_tiny_vlm import build


def test_the_script_rebuilds_the_shipped_files(tmp_path):
    shipped = Path(resolve_model_path("tiny-vlm"))
    built = build(tmp_path / "tiny_vlm")
    names = sorted(p.name for p in built.iterdir())
    assert names == sorted(p.name for p in shipped.iterdir())
    for name in names:
        assert (built / name).read_bytes() == (shipped / name).read_bytes(), name
    assert sum((built / name).stat().st_size for name in names) < 5 << 20
