"""A CPU emulator for the naive backend's CUDA kernels, so that CI checks them without a GPU.

How it works
------------
``build()`` compiles the real ``cuda_src/na_naive.cu`` (never a copy; the folder can be
overridden for mutation tests) with the host C++ compiler, as a shared library:

* ``include/cuda_shim.h`` stands in for CUDA: ``__global__``/``__device__`` become nothing or
  ``inline``; ``threadIdx``/``blockIdx`` are thread-local and ``blockDim``/``gridDim`` global;
  ``exp2f``, ``fmaxf``, ``__int_as_float``... map to the C library. ``include/cuda_fp16.h`` and
  ``include/cuda_bf16.h`` define ``__half`` (on GCC's ``_Float16``) and ``__nv_bfloat16``
  (round to nearest even) with the conversions the kernels use.
* ``harness.cpp`` includes the kernel source and exports one C entry point per kernel x
  element type x rank (``emu_<kernel>_<type>_<rank>``), which checks the launch's argument
  count and each array's element size (and the NAParams size) against the kernel's own
  signature, then runs the grid. One object per element type, compiled in parallel.
* Kernels without warp intrinsics run serially, thread after thread, blocks spread over a few
  worker threads. Kernels registered as warp kernels (d_rpb: ``__shfl_down_sync``) run 32
  lanes as std::threads in lockstep; every shuffle checks that all 32 lanes are at the same
  shuffle of the same warp, so a divergent shuffle is an error, not a hang.

``Emulator`` loads the library and offers ``get_kernel`` and ``launch`` with the signatures of
``natten_cupy._compile.get_kernel`` and ``natten_cupy._launch.launch``: a test monkeypatches
them into ``natten_cupy.backends.naive``, whose Python launcher then runs unchanged on NumPy
arrays (CuPy's ``get_array_module`` returns NumPy for them). ``launch`` checks the grid the
launcher asks for (1-D, at most ``MAX_BLOCKS``, block ``BLOCK``) and runs either that grid or
a smaller one (``max_grid``), which drives the kernels' grid-stride loops through many turns.

Limits
------
* Logic only: no CUDA compiler, no GPU memory model, no timing. ``_Float16``/bfloat16 round
  like the device's ``__float2half_rn``/``__float2bfloat16_rn``, but ``exp2f``/``log2f`` are
  the C library's (the device's are within 2 ulp) and host FMA contraction may differ.
* Races between threads are not detected (serial kernels run one thread at a time), nor is
  shared memory emulated (the naive kernels use none). Only ``__shfl_down_sync`` with a full
  mask is emulated; any other CUDA built-in the source starts using fails the build with
  g++'s message: add it to ``include/cuda_shim.h``.
* Out-of-bounds accesses are not trapped; tests catch them indirectly by placing arrays
  between NaN guard bands (reads show up as NaN, writes as changed guards).
* Large grids are slow (one host call per CUDA thread): keep cases small.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import os
import pathlib
import shutil
import subprocess

import numpy

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent.parent
SOURCE = "na_naive.cu"
TYPES = {"double": 0, "float": 1, "__half": 2, "__nv_bfloat16": 3}
FLAGS = ("-O2", "-std=c++17", "-fPIC", "-pthread")

__all__ = ["compiler", "unbuildable_reason", "build", "Emulator", "EmulationError"]


class EmulationError(RuntimeError):
    """A launch the harness refused or a kernel fault it detected (divergent warp...)."""


def compiler():
    """The C++ compiler to use (``$CXX`` or g++), or None."""
    return shutil.which(os.environ.get("CXX", "g++"))


def unbuildable_reason(cxx=None):
    """Why the emulator cannot be built here (no compiler, no ``_Float16``), or None."""
    cxx = cxx or compiler()
    if cxx is None:
        return f"no C++ compiler ({os.environ.get('CXX', 'g++')}) to build the CPU emulator"
    probe = "_Float16 h = (_Float16)1.5f; inline thread_local int t; int main() { return 0; }"
    done = subprocess.run([cxx, "-std=c++17", "-fsyntax-only", "-x", "c++", "-"], input=probe,
                          capture_output=True, text=True)
    if done.returncode:
        return f"{cxx} lacks C++17 or _Float16 (GCC >= 12 needed): {done.stderr.strip()[:200]}"
    return None


def build(out_dir, cuda_src=None, cxx=None):
    """Compile ``<cuda_src>/na_naive.cu`` (default: the repository's) into ``out_dir``.

    Returns the shared library's path; raises RuntimeError with the compiler's output.
    """
    cxx = cxx or compiler()
    cuda_src = pathlib.Path(cuda_src or ROOT / "cuda_src")
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if not (cuda_src / SOURCE).is_file():
        raise FileNotFoundError(cuda_src / SOURCE)
    common = [cxx, *FLAGS, f"-I{HERE / 'include'}", f"-I{cuda_src}"]

    def compile_one(index):
        obj = out_dir / f"harness{index}.o"
        cmd = [*common, f"-DEMU_TYPES={index}", "-c", str(HERE / "harness.cpp"), "-o", str(obj)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"emulator build failed: {' '.join(cmd)}\n{done.stderr[-6000:]}")
        return obj

    jobs = max(1, min(len(TYPES), os.cpu_count() or 1))
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        objects = list(pool.map(compile_one, TYPES.values()))
    lib = out_dir / "libna_naive_emulated.so"
    cmd = [cxx, "-shared", "-pthread", *map(str, objects), "-o", str(lib)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"emulator link failed: {' '.join(cmd)}\n{done.stderr[-6000:]}")
    return lib


def symbol(name_expression):
    """``na_fwd_naive<__half, 2>`` -> ``emu_na_fwd_naive_half_2``."""
    kernel, rest = name_expression.split("<", 1)
    ctype, rank = (s.strip() for s in rest.rstrip(">").split(","))
    if ctype not in TYPES:
        raise ValueError(f"no emulated element type {ctype!r} in {name_expression!r}")
    return f"emu_{kernel.strip()}_{ctype.lstrip('_')}_{int(rank)}"


class Kernel:
    """One emulated instantiation, called like a ``cupy.RawKernel``: ``(grid, block, args)``."""

    def __init__(self, emulator, name_expression):
        self.name = name_expression
        self._emu = emulator
        self._fn = getattr(emulator.lib, symbol(name_expression))
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int,
                             ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_longlong))

    def __call__(self, grid, block, args, shared_mem=0):
        if len(grid) != 1 or len(block) != 1:
            raise EmulationError(f"{self.name}: only 1-D grids and blocks are emulated")
        n = len(args)
        ptrs = (ctypes.c_void_p * n)()
        sizes = (ctypes.c_longlong * n)()
        keep = []
        for i, a in enumerate(args):
            if isinstance(a, numpy.ndarray):
                ptrs[i] = a.ctypes.data
                sizes[i] = a.dtype.itemsize
            elif isinstance(a, numpy.void):  # the NAParams struct, passed by value
                buf = ctypes.create_string_buffer(a.tobytes(), a.dtype.itemsize)
                keep.append(buf)
                ptrs[i] = ctypes.addressof(buf)
                sizes[i] = a.dtype.itemsize
            elif isinstance(a, (numpy.uint64, int)):  # a raw device pointer: only null here
                if int(a) != 0:
                    raise EmulationError(f"{self.name}: argument {i} is a raw non-null pointer")
                ptrs[i] = None
                sizes[i] = 0
            else:
                raise EmulationError(f"{self.name}: argument {i} of type {type(a).__name__} "
                                     "cannot be emulated")
        code = self._fn(int(grid[0]), int(block[0]), n, ptrs, sizes)
        self._emu.launches.append((self.name, tuple(grid), tuple(block)))
        if code:
            raise EmulationError(f"{self.name}: {self._emu.lib.emu_last_error().decode()}")


class Emulator:
    """Emulated ``get_kernel``/``launch`` for ``natten_cupy.backends.naive``.

    ``max_grid``: run at most this many blocks (the kernels grid-stride over the rest);
    None runs the grid the launcher asked for.
    """

    def __init__(self, lib_path, block=256, max_blocks=None):
        self.lib = ctypes.CDLL(str(lib_path))
        self.lib.emu_last_error.restype = ctypes.c_char_p
        self.block = block
        self.max_blocks = max_blocks
        self.max_grid = None
        self.launches = []
        self._kernels = {}

    def params_layout(self):
        """(field offsets in declaration order, struct size) of the C++ NAParams."""
        out = (ctypes.c_longlong * 64)()
        n = self.lib.emu_params_layout(out)
        return list(out[:n - 1]), out[n - 1]

    def get_kernel(self, source, name_expression, extra_options=()):
        if source != SOURCE or extra_options:
            raise EmulationError(f"only {SOURCE} without extra options is emulated")
        fn = self._kernels.get(name_expression)
        if fn is None:
            fn = self._kernels[name_expression] = Kernel(self, name_expression)
        return fn

    def launch(self, fn, grid, block, args, *, shared_mem=0, name="", backend="", tile=None):
        grid = tuple(int(g) for g in grid)
        block = tuple(int(b) for b in block)
        if block != (self.block,) or len(grid) != 1 or shared_mem:
            raise EmulationError(f"{name}: unexpected launch shape grid={grid} block={block} "
                                 f"shared_mem={shared_mem}")
        if self.max_blocks is not None and not 1 <= grid[0] <= self.max_blocks:
            raise EmulationError(f"{name}: grid {grid} outside 1..{self.max_blocks}")
        if self.max_grid is not None:
            grid = (min(grid[0], self.max_grid),)
        fn(grid, block, args, shared_mem=shared_mem)
