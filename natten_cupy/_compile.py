"""Kernel compile cache: CUDA sources under ``cuda_src/``, compiled by NVRTC at first use.

``get_kernel(source, name_expression)`` compiles one template instantiation through
``cupy.RawModule`` (CuPy keeps the binary in its on-disk cache) and memoizes the function
per process, keyed by a small frozen tuple. The compile options carry a hash of every file
under ``cuda_src/``, because CuPy's disk-cache key covers the source string and options but
not the headers pulled in with ``-I``: editing a header must invalidate the cache.

``nvrtc_check`` compiles the same source for a named architecture without any GPU or driver
(straight through NVRTC), returning the ptxas register and spill report; CI uses it to check
every registered instantiation.
"""

from __future__ import annotations

import functools
import hashlib
import os
import pathlib
import re

__all__ = ["cuda_src_dir", "source_hash", "compile_options", "get_kernel", "nvrtc_check",
           "cuda_include_dirs", "KernelReport", "compiled_keys", "nvrtc_check_many"]


@functools.lru_cache(maxsize=None)
def cuda_src_dir():
    """Folder of the CUDA sources: installed inside the package, or the in-tree top level."""
    env = os.environ.get("NATTEN_CUPY_CUDA_SRC")
    here = pathlib.Path(__file__).resolve().parent
    for candidate in ([pathlib.Path(env)] if env else []) + [here / "cuda_src",
                                                             here.parent / "cuda_src"]:
        if (candidate / "natten" / "common.cuh").is_file():
            return candidate
    raise FileNotFoundError(
        f"natten_cupy cannot find its CUDA sources (cuda_src/) next to {here}; "
        "reinstall the package or set NATTEN_CUPY_CUDA_SRC")


@functools.lru_cache(maxsize=None)
def source_hash():
    """Hash of every file under cuda_src/ (names and contents)."""
    h = hashlib.sha256()
    root = cuda_src_dir()
    for path in sorted(root.rglob("*")):
        if path.is_file() and path.suffix in (".cu", ".cuh", ".h"):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


def compile_options(extra=()):
    return ("-std=c++17", f"-I{cuda_src_dir()}", f"-DNATTEN_SRC_HASH=0x{source_hash()}ULL",
            *extra)


@functools.lru_cache(maxsize=None)
def _read(source):
    return (cuda_src_dir() / source).read_text()


_compiled = {}


def compiled_keys():
    """(source, name_expression, options) of the kernels compiled (or loaded from CuPy's disk
    cache) in this process, on any device."""
    return tuple(dict.fromkeys(k[:3] for k in _compiled))


def get_kernel(source, name_expression, extra_options=()):
    """The ``cupy.RawKernel`` of one template instantiation in ``cuda_src/<source>``, loaded
    on the current device. A module is loaded per device (a function handle belongs to one
    device's context); CuPy's disk cache keeps one compiled binary for all of them."""
    import cupy
    device = cupy.cuda.runtime.getDevice()
    key = (source, name_expression, tuple(extra_options), device)
    fn = _compiled.get(key)
    if fn is None:
        module = cupy.RawModule(code=_read(source), options=compile_options(extra_options),
                                name_expressions=[name_expression])
        fn = module.get_function(name_expression)
        _compiled[key] = fn
    return fn


# ---- GPU-free compilation (CI) ----------------------------------------------------------

def cuda_include_dirs():
    """Folders holding cuda_fp16.h and friends: a toolkit, or the pip CUDA packages."""
    dirs = []
    for var in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(var):
            dirs.append(pathlib.Path(os.environ[var]) / "include")
    try:
        import nvidia  # namespace package of the pip CUDA wheels
        for base in nvidia.__path__:
            base = pathlib.Path(base)
            dirs += [base / "cu13" / "include", base / "cuda_runtime" / "include",
                     base / "cuda_nvrtc" / "include", base / "cu12" / "include"]
    except ImportError:
        pass
    import shutil
    nvcc = shutil.which("nvcc")
    if nvcc:
        dirs.append(pathlib.Path(nvcc).resolve().parent.parent / "include")
    dirs.append(pathlib.Path("/usr/local/cuda/include"))
    return [d for d in dirs if (d / "cuda_fp16.h").is_file()]


class KernelReport(tuple):
    """(name_expression, arch, registers, spill_bytes, stack_bytes, smem_bytes, log)."""

    __slots__ = ()
    _fields = ("name", "arch", "registers", "spill_bytes", "stack_bytes", "smem_bytes", "log")

    def __getattr__(self, item):
        try:
            return self[self._fields.index(item)]
        except ValueError:
            raise AttributeError(item) from None


_PTXAS = re.compile(
    r"(?P<stack>\d+) bytes stack frame, (?P<st>\d+) bytes spill stores, "
    r"(?P<ld>\d+) bytes spill loads\s*\n.*?Used (?P<regs>\d+) registers"
    r"(?:, used \d+ barriers)?(?:, (?P<smem>\d+) bytes smem)?", re.S)


def nvrtc_check(source, name_expression, arch="sm_90", extra_options=()):
    """Compile one instantiation for ``arch`` through NVRTC alone (no GPU, no driver).

    Returns a KernelReport; raises RuntimeError with the compiler log on failure.
    """
    return nvrtc_check_many(source, [name_expression], arch, extra_options)[0]


def nvrtc_check_many(source, name_expressions, arch="sm_90", extra_options=()):
    """Compile several instantiations of one source in one NVRTC program (one parse).

    Returns one KernelReport per name expression, in order.
    """
    from cupy_backends.cuda.libs import nvrtc

    includes = cuda_include_dirs()
    if not includes:
        raise RuntimeError("no CUDA headers found (install nvidia-cuda-runtime or a toolkit)")
    opts = [*compile_options(extra_options), f"-arch={arch}", "--ptxas-options=-v",
            *[f"-I{d}" for d in includes]]
    prog = nvrtc.createProgram(_read(source), source, [], [])
    try:
        for name in name_expressions:
            nvrtc.addNameExpression(prog, name)
        try:
            nvrtc.compileProgram(prog, opts)
        except nvrtc.NVRTCError as e:
            raise RuntimeError(f"{source} failed to compile for {arch}:\n"
                               f"{nvrtc.getProgramLog(prog)}") from e
        log = nvrtc.getProgramLog(prog)
        lowered = [nvrtc.getLoweredName(prog, n) for n in name_expressions]
    finally:
        nvrtc.destroyProgram(prog)
    return [_report(name, low, arch, log) for name, low in zip(name_expressions, lowered)]


def _report(name, lowered, arch, log):
    """Parse ptxas -v output for one entry function."""
    entry = re.search(rf"Compiling entry function '{re.escape(lowered)}' for '{arch}'\n"
                      r"(?P<body>.*?)(?=Compiling entry function|\Z)", log, re.S)
    if not entry:
        raise RuntimeError(f"no ptxas report for {name} ({lowered}) in:\n{log[:2000]}")
    body = entry["body"]
    m = _PTXAS.search(body)
    if not m:
        raise RuntimeError(f"cannot parse ptxas report for {name}:\n{body[:800]}")
    return KernelReport((name, arch, int(m["regs"]), int(m["st"]) + int(m["ld"]),
                         int(m["stack"]), int(m["smem"] or 0), body))
