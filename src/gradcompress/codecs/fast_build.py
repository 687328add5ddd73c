"""Building the fused kernels' library (:mod:`gradcompress.codecs.fast`): the compiler, the flags, the cache.

``csrc/fast.cpp`` is compiled with any C++17 compiler (``$CXX`` or ``c++``) into a cache folder keyed by the
source, the flags, the compiler and the CPU; :func:`declare` gives the library's functions their C signatures.

The cache, and what is loaded from it: ``$GRADCOMPRESS_CACHE_DIR``, else
``$TORCH_EXTENSIONS_DIR``, else ``$XDG_CACHE_HOME/gradcompress`` (``~/.cache/gradcompress``),
else a ``gradcompress-<uid>`` folder in the temporary directory. Folders are created with
mode 0700, and a library is loaded only if it, its folder and the cache folder are owned
by the current user and writable by no one else (no symbolic links): on a shared machine
another user cannot plant a library at the predictable path. A folder that fails the
check is skipped with the reason in :func:`gradcompress.codecs.fast.failure`.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import stat
import subprocess
import tempfile
import threading
from pathlib import Path

CACHE_ENV = "GRADCOMPRESS_CACHE_DIR"
_FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-pthread", "-fvisibility=hidden",
          "-ffp-contract=off", "-fno-math-errno"]  # no FMA contraction: same float rounding as torch's ops


def cache_root() -> Path:
    """Where the library is built and looked for first (see the module documentation)."""
    root = os.environ.get(CACHE_ENV) or os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gradcompress"


def _uid() -> int:
    return os.getuid() if hasattr(os, "getuid") else 0


def check_private(path: Path, kind: str = "dir") -> None:
    """``RuntimeError`` unless ``path`` is a real ``kind`` ("dir" or "file", not a symbolic link)
    owned by the current user and not writable by group or others."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise RuntimeError(f"{path} is a symbolic link; not using it")
    if not (stat.S_ISDIR(st.st_mode) if kind == "dir" else stat.S_ISREG(st.st_mode)):
        raise RuntimeError(f"{path} is not a {'directory' if kind == 'dir' else 'regular file'}; not using it")
    if st.st_uid != _uid():
        raise RuntimeError(f"{path} is owned by uid {st.st_uid}, not by this user (uid {_uid()}); not using it")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise RuntimeError(f"{path} is writable by other users (mode {stat.S_IMODE(st.st_mode):o}); not using it")


def _private_dir(path: Path) -> None:
    """Create ``path`` (mode 0700; missing parents too) and check it with :func:`check_private`."""
    if not os.path.lexists(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
    check_private(path, "dir")


def compiler() -> str | None:
    """The C++ compiler to build with: ``$CXX``, else the first of c++, g++, clang++ on the path; None: none."""
    cxx = os.environ.get("CXX")
    if cxx:
        return shutil.which(cxx) or (cxx if os.path.isfile(cxx) else None)
    for name in ("c++", "g++", "clang++"):
        found = shutil.which(name)
        if found:
            return found
    return None


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    import platform

    return platform.processor() + platform.machine()


def build_library(cxx: str, source_path: Path) -> Path:
    source = source_path.read_bytes()
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    errors = []
    for extra in (["-march=native"], []):  # -march=native where the compiler knows it; the key has the CPU's flags
        flags = _FLAGS + extra
        key = hashlib.sha256(b"\0".join([source, " ".join(flags).encode(), cxx.encode(), version.encode(),
                                         _cpu_flags().encode() if extra else b""])).hexdigest()[:16]
        for root in (cache_root(), Path(tempfile.gettempdir()) / f"gradcompress-{_uid()}"):
            target = root / f"gradcompress_fast_{key}" / "libgcfast.so"
            try:
                _private_dir(root)
                _private_dir(target.parent)
                if os.path.lexists(target):
                    check_private(target, "file")
                    return target
            except (OSError, RuntimeError) as err:
                errors.append(f"{target.parent}: {err}")
                continue
            tmp = target.with_name(f"libgcfast.{os.getpid()}.{threading.get_ident()}.tmp.so")
            cmd = [cxx, *flags, str(source_path), "-o", str(tmp)]
            try:
                res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            except (OSError, subprocess.SubprocessError) as err:
                errors.append(f"{' '.join(cmd)}: {err}")
                break
            if res.returncode != 0 or not tmp.exists():
                errors.append(f"{' '.join(cmd)} failed:\n{(res.stderr or res.stdout)[-2000:]}")
                tmp.unlink(missing_ok=True)
                break  # the flags, not the folder: try the next flags
            os.chmod(tmp, 0o700)
            os.replace(tmp, target)  # atomic: concurrent builders each install a complete file
            check_private(target, "file")
            return target
    raise RuntimeError("\n".join(errors) or "no build attempted")


def declare(lib: ctypes.CDLL) -> None:
    """Give the library's functions their C signatures (result and argument types)."""
    c_int, c_i64, c_u32, c_u64, c_f, c_p = (ctypes.c_int, ctypes.c_int64, ctypes.c_uint32, ctypes.c_uint64,
                                            ctypes.c_float, ctypes.c_void_p)
    sigs = {
        "gc_version": (c_int, []),
        "gc_quantize": (c_int, [c_p, c_p, c_i64, c_i64, c_int, c_int, c_int, c_int, c_u64, c_p, c_p, c_p, c_int,
                                c_int, c_int, c_f, c_u64, c_int, c_int]),
        "gc_dequantize": (c_int, [c_p, c_p, c_i64, c_i64, c_int, c_int, c_int, c_int, c_f, c_int, c_p, c_int]),
        "gc_dequantize_mean": (c_int, [c_p, c_p, c_int, c_i64, c_i64, c_int, c_int, c_int, c_int, c_f, c_f, c_p,
                                       c_int]),
        "gc_quantize_mean": (c_int, [c_p, c_p, c_int, c_f, c_i64, c_i64, c_int, c_int, c_int, c_int, c_u64, c_p, c_p,
                                     c_int, c_int, c_int, c_f, c_u64, c_int]),
        "gc_pack": (c_int, [c_p, c_i64, c_int, c_p, c_int]),
        "gc_unpack": (c_int, [c_p, c_i64, c_int, c_p, c_int]),
        "gc_sample_keys": (None, [c_p, c_i64, c_i64, c_u64, c_p, c_int]),
        "gc_kth_largest": (c_u32, [c_p, c_i64, c_i64]),
        "gc_abs_key": (c_u32, [c_f]),
        "gc_collect": (c_p, [c_p, c_i64, c_u32, c_int]),
        "gc_collected_size": (c_i64, [c_p]),
        "gc_collected_free": (None, [c_p]),
        "gc_collected_finish": (None, [c_p, c_p]),
        "gc_select_top": (c_i64, [c_p, c_p, c_i64, c_i64, c_p]),
        "gc_random_positions": (c_int, [c_i64, c_i64, c_u64, c_p, c_int]),
    }
    for name, (res, args) in sigs.items():
        fn = getattr(lib, name)
        fn.restype = res
        fn.argtypes = args
