"""What hardware can do: the sourced spec sheet (`specs`), the roofline model (`roofline`), and this machine
measured (`measure`).

    from llmlab import hardware
    hardware.SPECS["A100 SXM"].bf16_tflops        # 312
    hardware.measure()                             # this machine's matmul FLOP/s and copy bandwidth
    hardware.matmul_peak()                         # the matmul FLOP/s alone (no bandwidths: quicker)
"""

from llmlab.hardware import roofline
from llmlab.hardware.machine import Measured, Rate, device_name, matmul_peak, measure, peak_matmul
from llmlab.hardware.specs import SPECS, Spec, cpu_peak_tflops, for_device, spec

__all__ = ["Measured", "Rate", "device_name", "measure", "matmul_peak", "peak_matmul", "roofline", "SPECS", "Spec",
           "spec", "for_device", "cpu_peak_tflops"]
