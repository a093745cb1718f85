"""FP8 weights: which scheme a checkpoint uses (``config.py``), the reference math
(``fp8_math.py``) and the layer method the linear layers hold (``fp8_linear.py``)."""

from nvray.quantization.config import Fp8Config, quant_config_for
from nvray.quantization.fp8_linear import Fp8LinearMethod, check_fp8_device, fused_input_group

__all__ = ["Fp8Config", "Fp8LinearMethod", "check_fp8_device", "fused_input_group",
           "quant_config_for"]
