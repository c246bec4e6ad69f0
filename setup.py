"""Builds kvbridge's C++ libraries, plugins and the Python extension with CMake.

`pip install .` runs this: CMake configures a build directory (KVBRIDGE_BUILD_DIR, default
build-py/<python ABI>/ in the source tree; ccache makes rebuilds cheap), builds the target
kvbridge_python (which pulls in libkvbridge, libkvbridge_store, the kernels, the plugins and
the daemon program), then `cmake --install --component python` lays them into the wheel's
kvbridge/ directory:

    kvbridge/_C.<abi>.so  kvbridge/libkvbridge.so  kvbridge/libkvbridge_store.so
    kvbridge/plugins/libkvb_transport_tcp.so  kvbridge/plugins/libkvb_transport_nccl.so
    kvbridge/plugins/libkvb_storage_dram.so   kvbridge/plugins/libkvb_storage_ssd.so
    kvbridge/plugins/libkvb_transport_ucx.so  (where the build found libucx-dev, which it links)
    kvbridge/bin/kvbridge   (the daemon `kvbridge master|node|status` runs, python/kvbridge/cli.py)

All with $ORIGIN rpaths, so the plugin loader finds the plugins next to the library with no
environment variable. The extension does not link torch, so one build serves venvs with
different torch versions (same CPython ABI: they share build-py/<abi>/).

Before CMake runs, the system packages the build needs are checked: a missing one stops the
install with one line naming the Debian package and `scripts/setup.sh`, which installs them
all. A configure that failed leaves no cache behind that a later install would trust.

Environment knobs: KVBRIDGE_BUILD_DIR (reuse an existing build, e.g. the `make build` tree),
KVBRIDGE_CUDA=AUTO|ON|OFF (the CUDA kernels), KVBRIDGE_BUILD_TYPE (Release),
CMAKE_BUILD_PARALLEL_LEVEL, KVBRIDGE_SKIP_PREFLIGHT=1 (skip the package check, e.g. on a
distribution whose files live elsewhere; CMake's own errors then apply).
"""

import glob
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
SETUP_HINT = "run scripts/setup.sh (as root) to install every build dependency"
# setup.cfg puts setuptools' scratch space under build-py/; a fresh clone has no such directory.
(ROOT / "build-py").mkdir(exist_ok=True)


class MissingDependency(SystemExit):
    def __init__(self, what, package):
        super().__init__(f"kvbridge: cannot build: {what} is missing (Debian/Ubuntu package "
                         f"{package}); {SETUP_HINT}, or `apt-get install {package}`")


def _prefixes():
    extra = [p for p in os.environ.get("CMAKE_PREFIX_PATH", "").split(os.pathsep) if p]
    return extra + ["/usr/local", "/usr"]


def _find_header(relpath):
    arch = sysconfig.get_config_var("MULTIARCH") or ""
    for prefix in _prefixes():
        for inc in (f"{prefix}/include", f"{prefix}/include/{arch}"):
            if os.path.exists(os.path.join(inc, relpath)):
                return True
    return False


def _find_cmake_package(dirname, filename):
    for prefix in _prefixes():
        for pattern in (f"{prefix}/lib/cmake/{dirname}/{filename}",
                        f"{prefix}/lib/*/cmake/{dirname}/{filename}",
                        f"{prefix}/lib64/cmake/{dirname}/{filename}"):
            if glob.glob(pattern):
                return True
    return False


def check_build_dependencies():
    """Raises MissingDependency for the first system package the build cannot do without."""
    if os.environ.get("KVBRIDGE_SKIP_PREFLIGHT") == "1":
        return
    tools = (("cmake", "cmake"), ("ninja", "ninja-build"), ("c++", "g++"),
             ("protoc", "protobuf-compiler"), ("grpc_cpp_plugin", "protobuf-compiler-grpc"))
    for tool, package in tools:
        if shutil.which(tool) is None:
            raise MissingDependency(f"the program `{tool}`", package)
    python_h = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if not python_h.exists():
        raise MissingDependency(f"Python.h for {sys.executable} ({python_h})",
                                f"python{sys.version_info[0]}-dev")
    headers = (("google/protobuf/message.h", "the protobuf headers", "libprotobuf-dev"),
               ("openssl/evp.h", "the OpenSSL headers", "libssl-dev"),
               ("civetweb.h", "the civetweb headers (the daemons' HTTP endpoint)",
                "libcivetweb-dev"))
    for header, what, package in headers:
        if not _find_header(header):
            raise MissingDependency(f"{what} ({header})", package)
    if not _find_cmake_package("grpc", "gRPCConfig.cmake"):
        raise MissingDependency("gRPC's C++ development files (gRPCConfig.cmake)", "libgrpc++-dev")


def _run(cmd):
    print("kvbridge setup:", " ".join(str(c) for c in cmd), flush=True)
    subprocess.run([str(c) for c in cmd], check=True)


def _stable_pybind11(build_dir):
    """pybind11's CMake directory, copied into the build tree: pip's isolated build environment
    (where pybind11 comes from) is deleted after the install, and a cache pointing into it
    would break the next one."""
    import pybind11

    src = Path(pybind11.__file__).resolve().parent
    dst = build_dir / f"pybind11-{pybind11.__version__}"
    if not (dst / ".complete").exists():
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
        (dst / ".complete").write_text(pybind11.__version__)
    cmake_dir = Path(pybind11.get_cmake_dir()).resolve()
    return dst / cmake_dir.relative_to(src)


def configure(build_dir):
    """Configures build_dir unless it holds a successful configure for the same settings. The
    stamp is written only after CMake succeeded; without it the old cache is discarded, so a
    configure that failed (a package was missing) is redone from scratch next time."""
    build_dir.mkdir(parents=True, exist_ok=True)
    pybind11_dir = _stable_pybind11(build_dir)
    args = ["-DCMAKE_BUILD_TYPE=" + os.environ.get("KVBRIDGE_BUILD_TYPE", "Release"),
            "-DKVBRIDGE_BUILD_TESTS=OFF", "-DKVBRIDGE_BUILD_BENCHMARKS=OFF",
            "-DKVBRIDGE_BUILD_PYTHON=ON",
            "-DKVBRIDGE_CUDA=" + os.environ.get("KVBRIDGE_CUDA", "AUTO"),
            "-DPython_EXECUTABLE=" + sys.executable,
            "-Dpybind11_DIR=" + str(pybind11_dir)]
    stamp = build_dir / ".kvbridge-configured"
    signature = "\n".join(args) + "\n"
    if stamp.exists() and stamp.read_text() == signature and (build_dir / "build.ninja").exists():
        return
    if stamp.exists():
        stamp.unlink()
    else:
        # No stamp: whatever cache is there did not come from a configure that succeeded.
        (build_dir / "CMakeCache.txt").unlink(missing_ok=True)
        shutil.rmtree(build_dir / "CMakeFiles", ignore_errors=True)
    try:
        _run(["cmake", "-G", "Ninja", "-S", ROOT, "-B", build_dir, *args])
    except subprocess.CalledProcessError:
        raise SystemExit(f"kvbridge: CMake could not configure {build_dir} (its messages are "
                         f"above); {SETUP_HINT}") from None
    stamp.write_text(signature)


def default_build_dir():
    abi = (sysconfig.get_config_var("EXT_SUFFIX") or ".so").strip(".").replace(".so", "")
    return ROOT / "build-py" / (abi or "default")


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        build_env = os.environ.get("KVBRIDGE_BUILD_DIR")
        build_dir = Path(build_env).resolve() if build_env else default_build_dir()
        if build_env and (build_dir / "CMakeCache.txt").exists():
            pass  # a tree configured by its owner (`make build`): built as it is
        else:
            check_build_dependencies()
            configure(build_dir)
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


# pip (setuptools.build_meta) runs this file as __main__; tests import it for its functions.
if __name__ == "__main__":
    setup(ext_modules=[Extension("kvbridge._C", sources=[])], cmdclass={"build_ext": CMakeBuild})
