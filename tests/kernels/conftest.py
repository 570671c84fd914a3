"""Kernel tests run on a GPU when there is one, else under Triton's CPU interpreter.

The interpreter must be chosen before any @triton.jit kernel is defined (the decorator reads
TRITON_INTERPRET), so it is set here, before anything imports banyan's Triton kernels; an explicit
TRITON_INTERPRET in the environment wins. Nothing outside tests/kernels imports them (the CPU kernel,
banyan.kernels.cpu_gemv, has no Triton in it and loads with the quantized layers).
"""

import importlib.util
import os
import sys

if "TRITON_INTERPRET" not in os.environ:
    import torch

    os.environ["TRITON_INTERPRET"] = "0" if torch.cuda.is_available() else "1"

if any(name.startswith("banyan.kernels.") and hasattr(module, "triton") for name, module in list(sys.modules.items())):
    raise RuntimeError("a Triton kernel of banyan.kernels was imported before tests/kernels/conftest.py chose the Triton mode")

if importlib.util.find_spec("triton") is None:  # pip install 'banyan[test]' brings it
    collect_ignore_glob = ["test_*.py"]
