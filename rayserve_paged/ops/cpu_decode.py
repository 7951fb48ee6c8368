"""The compiled CPU paged-decode kernel (csrc/paged_decode_cpu.cpp): build, cache, call.

The C++ source is compiled once per machine with the system C++ compiler into the project's
cache directory and loaded with ctypes; later processes load the cached library. The build
key hashes the source, the flags, the compiler and this CPU's feature flags (the code is
built with -march=native), so an edit, a new compiler or a different machine sharing the
cache gets its own build. Concurrent first builds are serialised with a file lock.

When there is no compiler, the build fails, or RAYSERVE_PAGED_CPU_KERNEL=0, `load()` returns
None after one log line, and the torch path of the backend is used instead.

    cache:  $RAYSERVE_PAGED_KERNEL_CACHE, else $RAYSERVE_PAGED_CACHE/kernels,
            else ~/.cache/rayserve_paged/kernels
    build:  $CXX (default c++) -O3 -march=native -fopenmp -shared -fPIC   (about 1 s)
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "paged_decode_cpu.cpp"
SYMBOL = "rayserve_paged_decode_f32"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-std=c++17", "-shared", "-fPIC")
DISABLE_ENV = "RAYSERVE_PAGED_CPU_KERNEL"  # "0": never build or load, use the torch path

_lock = threading.Lock()
_loaded: dict[str, PagedDecodeKernel | None] = {}


class PagedDecodeKernel:
    """ctypes wrapper of the compiled kernel: float32 CPU tensors, contiguous, int32 tables."""

    def __init__(self, library: ctypes.CDLL, path: Path) -> None:
        self.path = path
        self._fn = getattr(library, SYMBOL)
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        self._fn.argtypes = [p, p, p, p, p, p, i64, i64, i64, i64, i64, i64, i64, ctypes.c_float,
                             i64, ctypes.c_float, ctypes.c_int, p]  # fmt: skip
        self._fn.restype = ctypes.c_int
        self._bad = (ctypes.c_int64 * 2)()

    def __call__(
        self,
        out: torch.Tensor,  # [num_seqs, num_heads, head_dim] float32, written
        query: torch.Tensor,  # [num_seqs, num_heads, head_dim] float32
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] float32
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32, contiguous
        seq_lens: torch.Tensor,  # [num_seqs] int32
        scale: float,
        sliding_window: int | None = None,
        soft_cap: float | None = None,
    ) -> None:
        """Block ids and lengths are range-checked inside, before any cache read. With a
        sliding window only each sequence's last `sliding_window` positions are read; a
        soft-cap turns every score s into soft_cap * tanh(s / soft_cap)."""
        _check_tensors(out, query, key_cache, value_cache, block_tables, seq_lens)
        num_seqs, num_heads, head_dim = query.shape
        num_blocks, block_size, num_kv_heads, _ = key_cache.shape
        status = self._fn(
            out.data_ptr(), query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
            block_tables.data_ptr(), seq_lens.data_ptr(), num_seqs, num_heads, num_kv_heads, head_dim,
            num_blocks, block_size, block_tables.shape[1], scale, sliding_window or 0, soft_cap or 0.0,
            torch.get_num_threads(), self._bad,
        )  # fmt: skip
        if status == 1:
            seq = self._bad[0]
            raise ValueError(
                f"decode seq_lens[{seq}]={int(seq_lens[seq])} is negative or does not fit "
                f"{block_tables.shape[1]} blocks of {block_size} tokens"
            )
        if status == 2:
            seq, position = self._bad[0], self._bad[1]
            raise ValueError(
                f"decode block_tables[{seq}, {position}]={int(block_tables[seq, position])} is outside "
                f"the cache's [0, {num_blocks}) blocks"
            )


def _check_tensors(out, query, key_cache, value_cache, block_tables, seq_lens) -> None:
    """What the C code assumes and cannot check itself: dtypes, layouts, shapes."""
    for name, tensor in (("out", out), ("query", query), ("key_cache", key_cache), ("value_cache", value_cache)):
        if tensor.dtype != torch.float32 or tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError(f"paged decode kernel: {name} must be contiguous float32 on the CPU, got "
                             f"{tensor.dtype} on {tensor.device}, contiguous={tensor.is_contiguous()}")  # fmt: skip
    for name, tensor in (("block_tables", block_tables), ("seq_lens", seq_lens)):
        if tensor.dtype != torch.int32 or tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError(f"paged decode kernel: {name} must be contiguous int32 on the CPU, got "
                             f"{tensor.dtype}, contiguous={tensor.is_contiguous()}")  # fmt: skip
    num_seqs, num_heads, head_dim = query.shape
    if key_cache.dim() == 4 and key_cache.shape[1] < 1:  # the C code divides by the block size
        raise ValueError(f"paged decode kernel: the block size must be >= 1, got caches {tuple(key_cache.shape)}")
    if (
        out.shape != query.shape
        or key_cache.dim() != 4
        or value_cache.shape != key_cache.shape
        or key_cache.shape[3] != head_dim
        or num_heads % key_cache.shape[2]
        or block_tables.dim() != 2
        or block_tables.shape[0] != num_seqs
        or seq_lens.shape != (num_seqs,)
    ):
        raise ValueError(
            f"paged decode kernel: shapes do not fit: out {tuple(out.shape)}, query {tuple(query.shape)}, "
            f"caches {tuple(key_cache.shape)} / {tuple(value_cache.shape)}, block_tables "
            f"{tuple(block_tables.shape)}, seq_lens {tuple(seq_lens.shape)}"
        )


def load() -> PagedDecodeKernel | None:
    """The kernel, built on first use in this machine's cache; None when it cannot be had.
    Decided once per process (one log line either way)."""
    with _lock:
        if "kernel" not in _loaded:
            if os.environ.get(DISABLE_ENV, "1") == "0":
                logger.info("CPU paged-decode kernel disabled (%s=0): CPU decode uses the torch path", DISABLE_ENV)
                _loaded["kernel"] = None
            else:
                _loaded["kernel"] = _build_and_load()
        return _loaded["kernel"]


def cache_dir() -> Path:
    if os.environ.get("RAYSERVE_PAGED_KERNEL_CACHE"):
        return Path(os.environ["RAYSERVE_PAGED_KERNEL_CACHE"]).expanduser()
    if os.environ.get("RAYSERVE_PAGED_CACHE"):
        return Path(os.environ["RAYSERVE_PAGED_CACHE"]).expanduser() / "kernels"
    return Path.home() / ".cache" / "rayserve_paged" / "kernels"


def compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++") or shutil.which("clang++")


def _build_and_load() -> PagedDecodeKernel | None:
    return build_and_load(PagedDecodeKernel, "CPU paged-decode kernel", "CPU decode uses the slower torch path")


def build_and_load(
    wrapper, what: str, otherwise: str, source_path: Path = SOURCE, flags: tuple[str, ...] = FLAGS,
    includes: tuple[Path, ...] = (),
):
    """wrapper(library, path) of the cached build of `source_path`; None after one warning
    ("<what> unavailable (...): <otherwise>") when there is no compiler or the build or load
    fails. Every kernel in csrc/ is loaded this way."""
    cxx = compiler()
    if cxx is None:
        logger.warning("no C++ compiler found ($CXX, c++, g++, clang++): %s", otherwise)
        return None
    try:
        path = cached_build(cxx, source_path, flags, includes)
        return wrapper(ctypes.CDLL(str(path)), path)
    except (OSError, subprocess.SubprocessError, AttributeError) as error:
        logger.warning("%s unavailable (%s): %s", what, error, otherwise)
        return None


def cached_build(
    cxx: str, source_path: Path = SOURCE, flags: tuple[str, ...] = FLAGS, includes: tuple[Path, ...] = ()
) -> Path:
    """The library for this source (and the sources it #includes), flags, compiler and CPU:
    built under a file lock when missing. Every kernel in csrc/ is built and cached this way."""
    key = hashlib.sha256()
    for part in (source_path.read_bytes(), *(p.read_bytes() for p in includes), " ".join(flags).encode(),
                 _compiler_version(cxx), _cpu_flags()):  # fmt: skip
        key.update(part)
    directory = cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{source_path.stem}-{key.hexdigest()[:16]}.so"
    if path.is_file():
        return path
    with open(directory / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build at a time; the others find it done
        if not path.is_file():
            _compile(cxx, path, source_path, flags)
    return path


def _compile(cxx: str, path: Path, source_path: Path, flags: tuple[str, ...]) -> None:
    start = time.perf_counter()
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        result = subprocess.run(
            [cxx, *flags, str(source_path), "-o", tmp], capture_output=True, text=True, timeout=300
        )
        if result.returncode != 0:
            raise subprocess.SubprocessError(f"{cxx} failed: {result.stderr.strip()[-2000:]}")
        os.replace(tmp, path)  # atomic: a concurrent loader sees no half-written library
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    logger.info("compiled %s in %.1f s -> %s", source_path.name, time.perf_counter() - start, path)


def _compiler_version(cxx: str) -> bytes:
    result = subprocess.run([cxx, "--version"], capture_output=True, timeout=60)
    return result.stdout


def _cpu_flags() -> bytes:
    try:
        with open("/proc/cpuinfo", "rb") as f:
            for line in f:
                if line.startswith(b"flags"):
                    return line
    except OSError:
        pass
    return os.uname().machine.encode()
