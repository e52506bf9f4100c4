"""Choose Numba's CUDA simulator on machines without an NVIDIA GPU, before numba.cuda loads.

Numba reads NUMBA_ENABLE_CUDASIM once, when ``numba.cuda`` is first imported, so this must
run before any test module of this folder imports it. An explicit NUMBA_ENABLE_CUDASIM in the
environment always wins.
"""

from __future__ import annotations

import os
import shutil

if "NUMBA_ENABLE_CUDASIM" not in os.environ and shutil.which("nvidia-smi") is None:
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
