"""What loom.torch's modules share: the float dtypes a plugin takes, the current CUDA
stream of a tensor, and aligned scratch buffers."""
from typing import Optional

import torch

_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _stream(t: "torch.Tensor") -> Optional[int]:
    return torch.cuda.current_stream(t.device).cuda_stream if t.is_cuda else None


def _buffer(nbytes: int, device: "torch.device") -> tuple:
    """A 256-byte aligned scratch buffer of nbytes on device: (holder, address or None)."""
    if nbytes <= 0:
        return None, None
    holder = torch.empty(int(nbytes) + 256, dtype=torch.uint8, device=device)
    return holder, (holder.data_ptr() + 255) // 256 * 256
