"""A built wheel carries cuda_src/ inside the package and a non-editable install finds it; the
extras leave the GPU build to the user; the license the metadata names is shipped."""

import configparser
import pathlib
import re
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]   # tests/<kind>/ -> the repository


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
        "from natten_cupy._env import nvrtc_unavailable_reason as why;"
        "print(c.nvrtc_check(src, expr, 'sm_90').registers if why() is None else -1)"
    )
    res = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True,
                         text=True, env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stderr
    pkg_file, src_dir, regs = res.stdout.split()
    assert pathlib.Path(pkg_file).is_relative_to(site)
    assert pathlib.Path(src_dir).is_relative_to(site), src_dir
    assert int(regs) != 0


def _extras():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    return {name: [line.strip() for line in value.splitlines() if line.strip()]
            for name, value in cfg["options.extras_require"].items()}


def _dist(requirement):
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def test_only_the_gpu_extras_name_a_cupy_build():
    """The GPU build is the user's choice: `test` (or any other extra) must not install a
    second CuPy next to the one cuda12/cuda13 brought."""
    extras = _extras()
    cupy = {name: [r for r in reqs if _dist(r).startswith("cupy")]
            for name, reqs in extras.items()}
    assert cupy.pop("cuda12") == ["cupy-cuda12x>=14.2"]
    assert cupy.pop("cuda13") == ["cupy-cuda13x>=14.2"]
    assert not any(cupy.values()), cupy
    install_requires = configparser.ConfigParser()
    install_requires.read(ROOT / "setup.cfg")
    assert "cupy" not in install_requires["options"]["install_requires"]


def test_gpu_extras_bring_nvrtc_and_headers_of_their_cuda():
    extras = _extras()
    assert {_dist(r) for r in extras["cuda13"]} >= {"nvidia-cuda-nvrtc", "nvidia-cuda-runtime"}
    assert {_dist(r) for r in extras["cuda12"]} >= {"nvidia-cuda-nvrtc-cu12",
                                                    "nvidia-cuda-runtime-cu12"}
    # NVRTC 13 beside CuPy for CUDA 12 would be dead weight: only cuda13 brings it.
    assert not any(_dist(r) == "nvidia-cuda-nvrtc" for r in extras["test"])


def test_test_extra_runs_tests_in_parallel():
    """The README's test command passes -n auto: pytest-xdist must come with `test`."""
    assert "pytest-xdist" in {_dist(r) for r in _extras()["test"]}


def test_license_file_matches_the_metadata():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    assert cfg["metadata"]["license"] == "MIT"
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("MIT License")
    assert "natten_cupy contributors" in text
    assert "THE SOFTWARE IS PROVIDED \"AS IS\"" in text
