"""The wheel installs one top-level package, `twell_jax` (with the repository's `pallas_kernels/` and
`configs/` inside it), and the installed copy imports and runs outside the repository."""
import os
import pathlib
import shutil
import subprocess
import sys
import tomllib
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_every_package_folder_is_listed_and_mapped_under_twell_jax():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapped = setuptools["package-dir"]
    on_disk = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "twell_jax").rglob("__init__.py")}
    on_disk |= {f"twell_jax.{folder}" for folder in ("pallas_kernels", "configs")}
    assert set(setuptools["packages"]) == on_disk  # a new sub-package must be added to pyproject.toml
    assert all(name.startswith("twell_jax.") for name in setuptools["packages"] if name != "twell_jax")
    assert mapped == {"twell_jax.pallas_kernels": "pallas_kernels", "twell_jax.configs": "configs"}


@pytest.mark.slow
def test_the_wheel_has_no_top_level_configs_or_pallas_kernels_and_works_installed(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("twell_jax", "configs", "pallas_kernels"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "dist"), str(src)],
                   check=True, capture_output=True, timeout=300)
    wheel = next((tmp_path / "dist").glob("twell_jax-*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        archive.extractall(tmp_path / "site")
    assert {n.split("/")[0] for n in names} == {"twell_jax", wheel.name.split("-py")[0] + ".dist-info"}
    assert "twell_jax/pallas_kernels/twell_pack.py" in names and "twell_jax/configs/micro.py" in names
    # The installed copy, run from elsewhere: its kernels and presets import by their twell_jax names.
    # (Whether a top-level `configs` imports there depends on what else the environment holds, e.g. an
    # editable install of an older checkout: the wheel's own listing above is the check.)
    script = ("import twell_jax.configs, twell_jax.pallas_kernels.twell_pack as pack;"
              "print(pack.__file__, twell_jax.configs.get_config('micro').name)")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(tmp_path / "site" / "twell_jax" / "pallas_kernels" / "twell_pack.py"), "micro"]
