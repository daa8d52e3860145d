"""Make TorchTitan pick the CPU when no accelerator is present.

`torchtitan.tools.utils.device_type` falls back to "cuda" when torch reports no accelerator, and
several TorchTitan modules copy it at import time. Importing this module first (before any
`torchtitan.models` / `torchtitan.distributed` import) makes that fallback "cpu".
"""

import torch
import torchtitan.tools.utils as _tt_utils

if _tt_utils.device_type == "cuda" and not torch.cuda.is_available():
    _tt_utils.device_type, _tt_utils.device_module = "cpu", torch.cpu
