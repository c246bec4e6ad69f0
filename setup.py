"""Builds kvbridge's C++ libraries, plugins and the Python extension with CMake.

`pip install .` runs this: CMake configures a build directory (KVBRIDGE_BUILD_DIR, default
build-py/ in the source tree; ccache makes rebuilds cheap), builds the target kvbridge_python
(which pulls in libkvbridge, libkvbridge_store, the kernels and the plugins), then
`cmake --install --component python` lays them into the wheel's kvbridge/ directory:

    kvbridge/_C.<abi>.so  kvbridge/libkvbridge.so  kvbridge/libkvbridge_store.so
    kvbridge/plugins/libkvb_transport_tcp.so  kvbridge/plugins/libkvb_storage_dram.so

All with $ORIGIN rpaths, so the plugin loader finds the plugins next to the library with no
environment variable. Environment knobs: KVBRIDGE_BUILD_DIR (reuse an existing build, e.g.
the `make build` tree), KVBRIDGE_CUDA=AUTO|ON|OFF (the CUDA kernels), CMAKE_BUILD_PARALLEL_LEVEL.
"""

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def _run(cmd):
    print("kvbridge setup:", " ".join(str(c) for c in cmd), flush=True)
    subprocess.run([str(c) for c in cmd], check=True)


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        for tool in ("cmake", "ninja"):
            if shutil.which(tool) is None:
                raise RuntimeError(f"kvbridge needs `{tool}` to build (on Debian/Ubuntu run "
                                   "scripts/setup.sh, which installs every build dependency)")
        build_dir = Path(os.environ.get("KVBRIDGE_BUILD_DIR") or ROOT / "build-py").resolve()
        if not (build_dir / "CMakeCache.txt").exists():
            import pybind11

            _run(["cmake", "-G", "Ninja", "-S", ROOT, "-B", build_dir,
                  "-DCMAKE_BUILD_TYPE=" + os.environ.get("KVBRIDGE_BUILD_TYPE", "Release"),
                  "-DKVBRIDGE_BUILD_TESTS=OFF", "-DKVBRIDGE_BUILD_BENCHMARKS=OFF",
                  "-DKVBRIDGE_BUILD_PYTHON=ON",
                  "-DKVBRIDGE_CUDA=" + os.environ.get("KVBRIDGE_CUDA", "AUTO"),
                  "-DPython_EXECUTABLE=" + sys.executable,
                  "-Dpybind11_DIR=" + pybind11.get_cmake_dir()])
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))
        _run(["cmake", "--build", build_dir, "--target", "kvbridge_python", "-j", jobs])
        # Lay the package's native files into the build's kvbridge/ directory.
        target = Path(self.get_ext_fullpath(ext.name)).resolve().parent.parent
        _run(["cmake", "--install", build_dir, "--component", "python", "--prefix", target])
        built = Path(self.get_ext_fullpath(ext.name))
        if not built.exists():
            found = sorted(p.name for p in (target / "kvbridge").glob("_C*"))
            raise RuntimeError(
                f"kvbridge: {build_dir} built the extension as {found}, but this Python "
                f"({sys.executable}, suffix {sysconfig.get_config_var('EXT_SUFFIX')}) needs "
                f"{built.name}: that build directory was configured for another interpreter; "
                "set KVBRIDGE_BUILD_DIR to a fresh directory")


setup(ext_modules=[Extension("kvbridge._C", sources=[])], cmdclass={"build_ext": CMakeBuild})
