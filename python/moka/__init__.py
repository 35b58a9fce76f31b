"""moka: Mixture-of-Experts layers (routing, expert parallelism, fused experts) for PyTorch.

The layer itself is ``moka.torch.MoE``; ``moka.torch.moe_experts`` is the functional op for
models that route themselves. Tensors cross into moka's C++ library through DLPack, without a
copy; moka's CPU backend (float32/float64) runs where there is no GPU, its CUDA backend (bfloat16)
on Hopper GPUs.
"""
# torch before the extension: both need libnccl.so.2, and torch's copy is newer than a system
# one the extension may have been linked against; loading the extension first binds the older
# copy and torch then fails to import with an undefined NCCL symbol.
import torch  # noqa: F401

from . import _moka


class Error(RuntimeError):
    """A failure moka reported: the message names the rank and the offending input; ``code`` is
    a ``moka.ErrorCode`` (``shape_mismatch``, ``expert_out_of_range``, ``timeout``, ...)."""

    def __init__(self, message: str, code: "ErrorCode"):
        super().__init__(message)
        self.code = code


_moka._set_error_type(Error)
ErrorCode = _moka.ErrorCode
cuda_available = _moka.cuda_available
__commit__ = _moka.__commit__


def _version() -> str:
    # The installed package's metadata (python/pyproject.toml's version); a build-tree import,
    # which has none, gets the same number (kept equal to pyproject.toml and CMakeLists.txt's
    # project(VERSION), which tests/python/test_import.py checks).
    from importlib import metadata
    try:
        return metadata.version("moka")
    except metadata.PackageNotFoundError:
        return "0.1.0"


__version__ = _version()
__all__ = ["Error", "ErrorCode", "cuda_available"]
