"""The linear above 128 rows around cuBLAS (cuda/trellis_dense.cu): W_inner decoded to a dense fp16 matrix, and the
output Hadamard, svh and bias applied to the GEMM's fp32 result."""

from __future__ import annotations

import torch

from . import nvrtc
from .trellis_decode import CODEBOOK_ID
from .trellis_mma import OUT_DTYPE_ID

DENSE_KTILES = 4  # k-tiles per warp of trellis_dense, their words all loaded before the first decode


def dense_kernel(K: float, codebook: str, device: torch.device, name: str = "trellis_dense"):
    """The CUfunction `name` of trellis_dense.cu (trellis_dense or dense_epilogue) for (K, codebook)."""
    defines = (("K2", int(K * 2)), ("CB", CODEBOOK_ID[codebook]), ("DENSE_KTILES", DENSE_KTILES))
    return nvrtc.kernel("trellis_dense.cu", name, defines, device.index or 0)


def decode_dense(w, dense: torch.Tensor) -> torch.Tensor:
    """dense [k, n] fp16 <- W_inner of w, the same bits as format.decode."""
    ktiles, tiles_n = w.trellis.shape[:2]
    grid = (-(-tiles_n // 4), -(-ktiles // DENSE_KTILES), 1)
    nvrtc.launch(dense_kernel(w.K, w.codebook, dense.device), grid, 128, [w.trellis, dense, tiles_n, ktiles])
    return dense


def dense_epilogue(y: torch.Tensor, w, out: torch.Tensor) -> torch.Tensor:
    """out [rows, n] = Hn128(y) * svh + bias blockwise, y fp32 [rows, n] contiguous (rows < 2^31)."""
    rows, n = y.shape
    func = dense_kernel(w.K, w.codebook, y.device, "dense_epilogue")
    nvrtc.launch(func, (rows, -(-n // 512), 1), 128, [y, w.svh, w.bias, out, OUT_DTYPE_ID[out.dtype], n, out.stride(0)])
    return out
