"""Build a ``csrc`` CUDA file with ``nvcc`` and launch it through the CUDA driver (ctypes): a cubin
per source / arch / nvcc, cached in ``$MLA_SPEC_CACHE`` or ``~/.cache/mla_spec``, launched with
``cuLaunchKernelEx`` on PyTorch's current stream (graphs and PDL work). GPU only.
"""

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import threading
from pathlib import Path

import torch

__all__ = ["CudaKernel", "arrival_counters", "cuda_kernels_available", "compile_cubin", "nvcc_path",
           "CSRC", "tensor_map_2d"]

CSRC = Path(__file__).resolve().parent.parent / "csrc"
_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
_CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4
_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class _LaunchAttr(ctypes.Structure):
    # value: a 64-byte union; a c_char array field would read back as a bytes copy
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_int), ("value", ctypes.c_int * 16)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint),
                ("gridDimZ", ctypes.c_uint), ("blockDimX", ctypes.c_uint),
                ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttr)), ("numAttrs", ctypes.c_uint)]


def nvcc_path() -> str | None:
    """``$MLA_SPEC_NVCC``, ``$CUDA_HOME/bin/nvcc``, or ``nvcc`` on the PATH (None if none)."""
    for cand in (os.environ.get("MLA_SPEC_NVCC"),
                 os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return shutil.which("nvcc")


@functools.cache
def _nvcc_version(nvcc: str) -> str:
    return subprocess.run([nvcc, "--version"], capture_output=True, text=True,
                          check=True).stdout.strip().splitlines()[-1]


def _cache_dir() -> Path:
    root = os.environ.get("MLA_SPEC_CACHE") or os.path.join(Path.home(), ".cache", "mla_spec")
    return Path(root) / "cubin"


def compile_cubin(src: Path, arch: str = "sm_90") -> bytes:
    """The cubin of ``src`` for ``arch``, cached by source, headers, arch and nvcc version."""
    nvcc = nvcc_path()
    if nvcc is None:
        raise RuntimeError("nvcc not found (set MLA_SPEC_NVCC or CUDA_HOME): the CUDA kernels "
                           "are compiled on first use")
    text = src.read_bytes() + b"".join(h.read_bytes() for h in sorted(src.parent.glob("*.cuh")))
    key = hashlib.sha256(text + arch.encode() + _nvcc_version(nvcc).encode()).hexdigest()[:24]
    cache = _cache_dir()
    path = cache / f"{src.stem}-{arch}-{key}.cubin"
    if path.exists():
        return path.read_bytes()
    cache.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    res = subprocess.run([nvcc, f"-arch={arch}", "-cubin", "-O3", "-std=c++17", "-o", str(tmp),
                          str(src)], capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"nvcc failed on {src.name} for {arch}:\n{res.stderr[-2000:]}")
    os.replace(tmp, path)
    return path.read_bytes()


@functools.cache
def _libcuda():
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    lib.cuModuleLoadData.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p]
    lib.cuModuleGetFunction.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p,
                                        ctypes.c_char_p]
    lib.cuFuncSetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p,
                                     ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
    u64, u32 = ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32)
    lib.cuTensorMapEncodeTiled.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32,
                                           ctypes.c_void_p, u64, u64, u32, u32, ctypes.c_int,
                                           ctypes.c_int, ctypes.c_int, ctypes.c_int]
    return lib


_TMAP_DTYPES = {torch.uint8: 0, torch.float16: 6, torch.float32: 7, torch.bfloat16: 9}


def tensor_map_2d(t: torch.Tensor, box_cols: int, box_rows: int, swizzle: bool = True) -> bytes:
    """A TMA descriptor (``CUtensorMap``) of the 2-D ``t``: boxes of <= 128 bytes a row."""
    if t.dtype not in _TMAP_DTYPES or t.dim() != 2 or t.stride(1) != 1:
        raise ValueError(f"tensor_map_2d takes a 2-D tensor with unit column stride of "
                         f"{list(_TMAP_DTYPES)} (got {t.dtype}, {tuple(t.shape)})")
    esz = t.element_size()
    if (t.stride(0) * esz) % 16 or t.data_ptr() % 16 or box_cols * esz > 128:
        raise ValueError("tensor_map_2d: 16-byte aligned base and row stride, and a box "
                         "row of at most 128 bytes, are required")
    u64, u32 = ctypes.c_uint64, ctypes.c_uint32
    out = (ctypes.c_ubyte * 128)()
    dims = (u64 * 2)(t.shape[1], t.shape[0])
    strides = (u64 * 1)(t.stride(0) * esz)
    box = (u32 * 2)(box_cols, box_rows)
    elem = (u32 * 2)(1, 1)
    # interleave none, swizzle 128B (3) or none (0), L2 promotion 256B (3), out-of-bounds
    # fill zeros (0)
    _check(_libcuda().cuTensorMapEncodeTiled(ctypes.addressof(out), _TMAP_DTYPES[t.dtype], 2,
                                             t.data_ptr(), dims, strides, box, elem, 0,
                                             3 if swizzle else 0, 3, 0),
           f"encoding a tensor map of {tuple(t.shape)}")
    return bytes(out)


def _check(res: int, what: str) -> None:
    if res != 0:
        msg = ctypes.c_char_p()
        _libcuda().cuGetErrorString(res, ctypes.byref(msg))
        raise RuntimeError(f"{what}: CUDA driver error {res} "
                           f"({(msg.value or b'?').decode()})")


@functools.cache
def cuda_kernels_available(device: torch.device) -> str | None:
    """None when the hand-written CUDA kernels can run on ``device``, else why not."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return "the CUDA kernels need a CUDA device"
    if torch.cuda.get_device_capability(device) < (9, 0):
        return "the CUDA kernels need sm_90 (Hopper) or newer (bulk copies, mbarriers, PDL)"
    if nvcc_path() is None:
        return "nvcc not found (set MLA_SPEC_NVCC or CUDA_HOME)"
    try:
        _libcuda()
    except OSError as e:
        return f"libcuda.so.1 not loadable: {e}"
    return None


class CudaKernel:
    """A ``csrc`` file's ``extern "C"`` kernel, loaded per device, called with a ctypes struct."""

    _lock = threading.Lock()

    def __init__(self, src: str, name: str, arch: str = "sm_90"):
        self.src, self.name, self.arch = CSRC / src, name, arch
        self._fn: dict[int, tuple[int, int]] = {}  # device index -> (function, smem attribute)

    def _function(self, idx: int, smem: int) -> int:
        got = self._fn.get(idx)
        if got is None or got[1] < smem:
            with self._lock, torch.cuda.device(idx):
                torch.cuda.init()
                torch.empty(1, device=f"cuda:{idx}")  # the primary context is current
                lib = _libcuda()
                fn = got[0] if got else None
                if fn is None:
                    mod = ctypes.c_void_p()
                    _check(lib.cuModuleLoadData(ctypes.byref(mod),
                                                compile_cubin(self.src, self.arch)),
                           f"loading {self.src.name}")
                    f = ctypes.c_void_p()
                    _check(lib.cuModuleGetFunction(ctypes.byref(f), mod, self.name.encode()),
                           f"finding {self.name} in {self.src.name}")
                    fn = f.value
                _check(lib.cuFuncSetAttribute(fn, _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                              smem), f"{self.name}: {smem} B of shared memory")
                got = (fn, smem)
                self._fn[idx] = got
        return got[0]

    def __call__(self, grid, block: int, smem: int, params: ctypes.Structure,
                 device: torch.device, pdl: bool = False, cluster: int = 1) -> None:
        """``cluster > 1``: thread-block clusters of ``(cluster, 1, 1)`` CTAs."""
        self.prepared(grid, block, smem, device, pdl, cluster)(params)

    def prepared(self, grid, block: int, smem: int, device: torch.device, pdl: bool = False,
                 cluster: int = 1):
        """``launch(params)``: this launch configuration built once, each call launching on the
        current stream (a planned call's relaunch: a few µs)."""
        idx = device.index if device.index is not None else torch.cuda.current_device()
        fn = self._function(idx, smem)
        cfg = _LaunchConfig(*grid, block, 1, 1, smem, None, None, 0)
        attrs = (_LaunchAttr * 2)()
        n = 0
        if pdl:
            attrs[n].id = _CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            attrs[n].value[0] = 1  # programmaticStreamSerializationAllowed
            n += 1
        if cluster > 1:
            attrs[n].id = _CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
            attrs[n].value[0], attrs[n].value[1], attrs[n].value[2] = cluster, 1, 1
            n += 1
        if n:
            cfg.attrs = ctypes.cast(attrs, ctypes.POINTER(_LaunchAttr))
            cfg.numAttrs = n
        cfg_ref, launch_ex, stream = ctypes.byref(cfg), _libcuda().cuLaunchKernelEx, \
            torch._C._cuda_getCurrentRawStream

        def launch(params: ctypes.Structure) -> None:
            cfg.hStream = stream(idx)
            arg = ctypes.c_void_p(ctypes.addressof(params))
            _check(launch_ex(cfg_ref, fn, ctypes.byref(arg), None), f"launching {self.name}")
        launch.keep = attrs  # the attributes' memory lives as long as the launch
        return launch


# ---- arrival counters of last-CTA kernels: the last arrival resets its counter (no memset) -----
#: the smallest buffer cached (256 KB: 64 Ki pieces, e.g. 2048 requests x 32 row blocks)
MIN_COUNTERS = 1 << 16

_CACHE: dict[torch.device, torch.Tensor] = {}
_OUTGROWN: list[torch.Tensor] = []  # a graph captured earlier may still point at one


def arrival_counters(n: int, device: torch.device) -> torch.Tensor:
    """A zeroed int32 buffer of ``n``+ counters on ``device``, cached (except during a capture)."""
    device = torch.device(device)
    buf = _CACHE.get(device)
    if buf is not None and buf.numel() >= n:
        return buf
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.zeros(max(n, 1), dtype=torch.int32, device=device)
    if buf is not None:
        _OUTGROWN.append(buf)
    buf = _CACHE[device] = torch.zeros(max(n, MIN_COUNTERS), dtype=torch.int32, device=device)
    return buf
