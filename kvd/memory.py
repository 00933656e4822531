"""The KV cache itself, when the daemon owns it (``kv_cache = "LAYERS,KV_HEADS,HEAD_DIM[,DTYPE]"``).

Then every engine reads and writes one shared KV cache: a prefix one engine computed is read by the
others from the very same blocks, and the daemon, not the engines, performs what its bookkeeping
decides: each copy-on-write copy before the reply that reports it, the bytes of a swap before the
swap's reply.

Layout, the one ``kvd_kernels``' copy and swap kernels take (``block_dim = 2``)::

    kv[layer, k_or_v, block, position_in_block, kv_head, head_dim]     one array per pool

* device "cpu": the GPU pool is a shared-memory segment ``/dev/shm/kvd_<pid>_<epoch>_kv`` (mode
  0660 and the daemon's group: engines in that group), which clients map read-write; copies are
  numpy copies;
* device "cuda:N": a torch tensor on the device, exported once over CUDA IPC; copies and swaps are
  the Triton kernels, and the stream is synchronized before the reply;
* the CPU swap pool (``num_cpu_blocks``) is the daemon's own (pinned on CUDA).

The hello reply carries the description (field ``kv``, see ``kvd.protocol``): ``shape``, ``dtype``,
and ``name`` (shm) or the IPC handle fields (cuda, as for the session buffers of
``kvd.gpu_session``).
"""

from __future__ import annotations

import mmap
import os

import numpy as np

from kvd.shm import set_access

KV_SEGMENT_MODE = 0o660
#: KV dtypes and the numpy dtype of the same width that holds their bytes on CPU.
DTYPES = {"float16": "<f2", "bfloat16": "<u2", "float32": "<f4", "float8_e4m3fn": "u1", "float8_e5m2": "u1"}
SHM_DIR = "/dev/shm"


def available_memory() -> int:
    """Bytes this process may still allocate: MemAvailable, or less under a cgroup v2 limit."""
    available = 1 << 62
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    try:
        with open("/proc/self/cgroup") as fh:
            path = next((ln.split(":", 2)[2].strip() for ln in fh if ln.startswith("0::")), None)
        if path is not None:
            base = os.path.join("/sys/fs/cgroup", path.lstrip("/"))
            with open(os.path.join(base, "memory.max")) as fh:
                limit = fh.read().strip()
            if limit != "max":
                with open(os.path.join(base, "memory.current")) as fh:
                    available = min(available, int(limit) - int(fh.read()))
    except (OSError, ValueError):
        pass
    return available


def parse_kv_cache(text: str) -> tuple[int, int, int, str]:
    """"32,8,128,bfloat16" -> (layers, kv heads, head dim, dtype); ValueError when malformed."""
    parts = [p.strip() for p in text.split(",")]
    if len(parts) not in (3, 4):
        raise ValueError("expected LAYERS,KV_HEADS,HEAD_DIM[,DTYPE]")
    try:
        layers, heads, dim = (int(p) for p in parts[:3])
    except ValueError:
        raise ValueError("LAYERS, KV_HEADS and HEAD_DIM must be integers") from None
    dtype = parts[3] if len(parts) == 4 else "float16"
    if min(layers, heads, dim) < 1:
        raise ValueError("LAYERS, KV_HEADS and HEAD_DIM must be >= 1")
    if dtype not in DTYPES:
        raise ValueError(f"DTYPE must be one of {', '.join(DTYPES)}")
    return layers, heads, dim, dtype


def pool_shape(spec: tuple[int, int, int, str], num_blocks: int, block_size: int) -> list[int]:
    layers, heads, dim, _ = spec
    return [layers, 2, num_blocks, block_size, heads, dim]


class KvMemory:
    """The daemon's KV cache: the GPU pool (shared with the engines) and the CPU swap pool."""

    def __init__(self, spec, num_blocks: int, num_cpu_blocks: int, block_size: int, device: str, name: str,
                 gid: int = -1):
        self.spec = spec
        self.dtype = spec[3]
        self.shape = pool_shape(spec, num_blocks, block_size)
        cpu_shape = pool_shape(spec, max(num_cpu_blocks, 1), block_size)
        self.cuda = device.startswith("cuda")
        self.name = name
        self._fd = self._mm = None
        if self.cuda:
            import torch

            tdt = getattr(torch, self.dtype)
            self.gpu = torch.zeros(self.shape, dtype=tdt, device=device)
            self.cpu = torch.zeros(cpu_shape, dtype=tdt, pin_memory=True)
            self.info = self._export_cuda()
        else:
            self.gpu = self._create_shm(name, gid)
            self.cpu = np.zeros(cpu_shape, DTYPES[self.dtype])
            self.info = {"kind": "shm", "name": name, "shape": self.shape, "dtype": self.dtype}

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(DTYPES[self.dtype]).itemsize

    def _create_shm(self, name: str, gid: int) -> np.ndarray:
        path = os.path.join(SHM_DIR, name)
        st = os.statvfs(SHM_DIR)
        if st.f_bavail * st.f_frsize < self.nbytes:  # a sparse file past it would SIGBUS on first touch
            raise MemoryError(f"the KV cache needs {self.nbytes} bytes, {SHM_DIR} has {st.f_bavail * st.f_frsize} free")
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            set_access(self._fd, KV_SEGMENT_MODE, gid)  # engines of the daemon's group write K/V
            os.ftruncate(self._fd, self.nbytes)
            self._mm = mmap.mmap(self._fd, self.nbytes)
        except BaseException:
            os.close(self._fd)
            os.unlink(path)
            raise
        return np.ndarray(self.shape, DTYPES[self.dtype], self._mm)

    def _export_cuda(self) -> dict:
        st = self.gpu.untyped_storage()
        (dev, handle, size, off, rc, rco, ev, evs) = st._share_cuda_()
        import torch

        return {"kind": "cuda", "dev": int(dev), "uuid": str(torch.cuda.get_device_properties(int(dev)).uuid),
                "h": bytes(handle).hex(), "sz": int(size), "off": int(off),
                "rc": bytes(rc).hex(), "rco": int(rco), "ev": None if ev is None else bytes(ev).hex(),
                "evs": bool(evs), "shape": self.shape, "dtype": self.dtype}

    # ---- what the bookkeeping decided --------------------------------------------------------------
    def copy(self, pairs: np.ndarray) -> None:
        """Copy-on-write: block src -> block dst for each (src, dst) pair, within the GPU pool."""
        if not len(pairs):
            return
        if self.cuda:
            import torch
            from kvd_kernels import copy_blocks

            copy_blocks(self.gpu, torch.from_numpy(pairs.astype(np.int64)).to(self.gpu.device))
            _sync(self.gpu)
        else:
            self.gpu[:, :, pairs[:, 1]] = self.gpu[:, :, pairs[:, 0]]

    def swap_out(self, mapping: np.ndarray) -> None:
        """(gpu block, cpu block) pairs: GPU pool -> CPU pool."""
        self._swap(self.gpu, self.cpu, mapping)

    def swap_in(self, mapping: np.ndarray) -> None:
        """(cpu block, gpu block) pairs: CPU pool -> GPU pool."""
        self._swap(self.cpu, self.gpu, mapping)

    def _swap(self, src, dst, mapping: np.ndarray) -> None:
        if not len(mapping):
            return
        if self.cuda:
            import torch
            from kvd_kernels import swap_blocks

            swap_blocks(src, dst, torch.from_numpy(mapping.astype(np.int64)))
            _sync(self.gpu)
        else:
            dst[:, :, mapping[:, 1]] = src[:, :, mapping[:, 0]]

    def close(self) -> None:
        """Release the pools; the shared-memory segment is unlinked (mappings stay valid)."""
        if self._mm is not None:
            self.gpu = None
            try:
                os.unlink(os.path.join(SHM_DIR, self.name))
            except FileNotFoundError:
                pass
            try:
                self._mm.close()
            except BufferError:  # a view is still alive somewhere: the mapping goes with it
                pass
            os.close(self._fd)
            self._mm = self._fd = None


def _sync(tensor) -> None:
    import torch

    torch.cuda.synchronize(tensor.device)
