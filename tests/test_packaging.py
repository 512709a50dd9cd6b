"""A built wheel carries cuda_src/ inside the package and a non-editable install finds it."""

import pathlib
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    pytest.importorskip("setuptools")
    pytest.importorskip("wheel")
    out = tmp_path_factory.mktemp("wheel")
    build = tmp_path_factory.mktemp("build")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(out), str(ROOT)], check=True, cwd=build)
    wheels = list(out.glob("natten_cupy-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def test_wheel_carries_every_kernel_source(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = [p.relative_to(ROOT).as_posix() for p in (ROOT / "cuda_src").rglob("*")
               if p.suffix in (".cu", ".cuh")]
    assert sources
    missing = [s for s in sources if f"natten_cupy/{s}" not in names]
    assert not missing, missing


def test_installed_wheel_finds_its_kernels(wheel, tmp_path):
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                    str(site), str(wheel)], check=True)
    probe = (
        "import natten_cupy, natten_cupy._compile as c;"
        "print(natten_cupy.__file__);"
        "print(c.cuda_src_dir());"
        "from natten_cupy.backends import get_backend;"
        "src, expr = get_backend('naive').instantiations()[0];"
        "print(c.nvrtc_check(src, expr, 'sm_90').registers if c.cuda_include_dirs() else -1)"
    )
    res = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True,
                         text=True, env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stderr
    pkg_file, src_dir, regs = res.stdout.split()
    assert pathlib.Path(pkg_file).is_relative_to(site)
    assert pathlib.Path(src_dir).is_relative_to(site), src_dir
    assert int(regs) != 0
