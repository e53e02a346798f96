"""The one name -> dtype map for configs and the command line: model.param_dtype, model.reduce_dtype and
export.dtype (`python -m ckpt export --dtype`). Its own module, so the model builder does not import the exporter.

    python -m pytest tests/test_hf.py -q -k export
"""

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # export also takes "auto"
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
