"""Build hook. Metadata lives in pyproject.toml; compiled parts are added here.

wsync._cpu (csrc/delta_cpu.cpp, the C++ CPU backend) is optional: without a
compiler, or if the build fails, the package still installs and wsync runs on
the reference backend. The reason is left in wsync/_cpu.build-error.txt, and
``wsync.backend()`` reports it. Plain `pip install -e .` builds the module in
place, next to the sources.
"""
import os
import shutil
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

NOTE = "_cpu.build-error.txt"

# Tried in order. The kernels' threads are std::thread (csrc/parallel.h), so
# no OpenMP runtime is needed; -pthread only matters on older glibc.
FLAGS = {
    "unix": [
        (["-O3", "-std=c++17", "-pthread", "-fvisibility=hidden"], ["-pthread"]),
        (["-O3", "-std=c++17", "-fvisibility=hidden"], []),
    ],
    "msvc": [(["/O2", "/std:c++17"], [])],
}


class OptionalBuildExt(build_ext):
    """build_ext that never fails the install: it records why, and wsync falls back to `ref`."""

    def run(self):
        # setuptools builds in-place and editable installs in build/ and copies the
        # module over afterwards, clearing self.inplace meanwhile: remember it.
        self._in_source = bool(self.inplace or getattr(self, "editable_mode", False))
        try:
            super().run()
        except Exception as e:  # e.g. no compiler found while setting one up
            for ext in self.extensions:
                self._note(ext, f"{type(e).__name__}: {e}")

    def build_extension(self, ext):
        errors = []
        for cflags, lflags in FLAGS.get(self.compiler.compiler_type, FLAGS["unix"]):
            ext.extra_compile_args, ext.extra_link_args = cflags, lflags
            try:
                super().build_extension(ext)
            except Exception as e:
                errors.append(f"{type(e).__name__}: {e}")
                print(f"WARNING: building {ext.name} with {' '.join(cflags)} failed: {errors[-1]}", file=sys.stderr)
                continue
            self._note(ext, None)
            return
        compiler = (getattr(self.compiler, "compiler_so", None) or [self.compiler.compiler_type])[0]
        self._note(ext, f"the build failed ({errors[-1].split(':')[0]} from {compiler}; its output is in the install log)")

    def _note(self, ext, reason):
        """Write (or clear) the failure note beside where the module goes, built or in place."""
        for folder in self._module_dirs(ext):
            path = os.path.join(folder, NOTE)
            if reason is None:
                if os.path.exists(path):
                    os.remove(path)
                continue
            os.makedirs(folder, exist_ok=True)
            with open(path, "w") as f:
                f.write(reason + "\n")
            stale = os.path.join(folder, os.path.basename(self.get_ext_fullpath(ext.name)))
            if os.path.exists(stale):  # an older build must not pass for this source
                os.remove(stale)
        if reason is not None:
            print(f"WARNING: optional extension {ext.name} not built: {reason}; wsync will use its reference "
                  "backend", file=sys.stderr)

    def _module_dirs(self, ext):
        # setuptools builds into build/lib and then copies in-place or editable
        # builds into the source tree; only the module itself is copied, so the
        # note goes to both places.
        dirs = {os.path.dirname(self.get_ext_fullpath(ext.name))}
        if getattr(self, "_in_source", False):
            package = ext.name.rpartition(".")[0]
            dirs.add(os.path.abspath(self.get_finalized_command("build_py").get_package_dir(package)))
        return dirs


class BuildPyWithKernels(build_py):
    """build_py that also ships the CUDA kernel sources as wsync/_csrc: the CUDA backend compiles them with NVRTC at
    run time, so an installed wheel needs them beside the package. An editable install reads csrc/ of the
    checkout instead (wsync.backends.cuda.csrc_dir)."""

    KERNEL_SUFFIXES = (".cu", ".cuh", ".h")

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        target = Path(self.build_lib) / "wsync" / "_csrc"
        target.mkdir(parents=True, exist_ok=True)
        for source in sorted(Path(__file__).resolve().parent.joinpath("csrc").iterdir()):
            if source.suffix in self.KERNEL_SUFFIXES:
                shutil.copyfile(source, target / source.name)


setup(
    ext_modules=[
        Extension(
            "wsync._cpu",
            sources=["csrc/delta_cpu.cpp", "csrc/xxh3_avx2.cpp", "csrc/ws_v2_cpu.cpp"],
            depends=["csrc/delta_kernels.h", "csrc/checksum_kernels.h", "csrc/parallel.h", "csrc/xxh3_dispatch.h", "csrc/xxh3_avx2.h", "csrc/xxh3_stream.h", "csrc/xxh3_stream_impl.h", "csrc/streams.h",
                     "csrc/xxh3.h", "csrc/ws_common.cuh", "csrc/ws_v2.h", "csrc/ws_v2.cuh", "csrc/ws_v2_planes.h", "csrc/ws_quant.cuh"],
            include_dirs=["csrc"],
            language="c++",
            optional=True,
        )
    ],
    cmdclass={"build_ext": OptionalBuildExt, "build_py": BuildPyWithKernels},
)
