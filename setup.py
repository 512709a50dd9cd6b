"""Build hook: the wheel carries the top-level cuda_src/ inside the package.

The kernels are compiled at run time, so their sources are package data. In the source
tree they live at the top level (cuda_src/, next to natten_cupy/); a built wheel holds them
at natten_cupy/cuda_src/, where natten_cupy._compile.cuda_src_dir() looks first.
"""

import pathlib
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPyWithKernels(build_py):
    def run(self):
        super().run()
        src = pathlib.Path(__file__).parent / "cuda_src"
        dst = pathlib.Path(self.build_lib) / "natten_cupy" / "cuda_src"
        if dst.exists():
            shutil.rmtree(dst)
        shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*~", "__pycache__"))


setup(cmdclass={"build_py": BuildPyWithKernels})
