"""Dense bf16 peak FLOP/s per device, keyed by the device kind the frameworks report.

One table for the core and every hook: MFU and HFU divide by these numbers, so each one names
where it comes from. Every figure is the *dense* (no structured sparsity) bf16 tensor-core peak of
one device (one GPU, one TPU chip): vendors print the 2:4-sparsity figure first, which is twice
the dense one. A device kind not in the table has no peak: MFU stays empty (the resolver warns
once) rather than borrowing another device's peak. ``init(peak_tflops=...)`` overrides the table.

Kinds are matched case-insensitively as substrings of what JAX's ``Device.device_kind`` and
``torch.cuda.get_device_name()`` return (``"NVIDIA H100 80GB HBM3"``, ``"TPU v5 lite"``), first
match wins: the PCIe/NVL variants come before the SXM part they contain. A leaf module.
"""

from __future__ import annotations

from typing import NamedTuple


class Peak(NamedTuple):
    match: str  # lower-case substring of the reported device kind
    tflops: float  # dense bf16 TFLOP/s of one device
    device: str  # the device, as a person names it
    source: str  # where the number comes from


_H100 = "NVIDIA H100 datasheet (nvidia.com/en-us/data-center/h100): BF16 Tensor Core, half the sparsity figure"
_H200 = "NVIDIA H200 datasheet (nvidia.com/en-us/data-center/h200): BF16 Tensor Core, half the sparsity figure"
_V5E = "Cloud TPU v5e docs (cloud.google.com/tpu/docs/v5e): 197 TFLOPS bf16 per chip"
_V6E = "Cloud TPU v6e docs (cloud.google.com/tpu/docs/v6e): 918 TFLOPS bf16 per chip"
_A100 = "NVIDIA A100 datasheet (nvidia.com/en-us/data-center/a100): BF16 Tensor Core 312 TFLOPS dense"

PEAKS: tuple[Peak, ...] = (
    Peak("gb200", 2500.0, "NVIDIA GB200 (per GPU)",
         "NVIDIA GB200 NVL72 spec (nvidia.com/en-us/data-center/gb200-nvl72): 360 PFLOPS FP16/BF16 sparse "
         "/ 72 GPUs / 2"),
    Peak("b200", 2250.0, "NVIDIA B200",
         "NVIDIA HGX B200 spec (nvidia.com/en-us/data-center/hgx): 4.5 PFLOPS FP16/BF16 sparse per GPU / 2"),
    Peak("h100 pcie", 756.0, "NVIDIA H100 PCIe", _H100 + " (1,513 sparse)"),
    Peak("h100 nvl", 835.0, "NVIDIA H100 NVL", _H100 + " (1,671 sparse)"),
    Peak("h200 nvl", 835.0, "NVIDIA H200 NVL", _H200 + " (1,671 sparse)"),
    Peak("gh200", 989.0, "NVIDIA GH200", "NVIDIA GH200 datasheet: the H100 SXM tensor cores (1,979 sparse / 2)"),
    Peak("h200", 989.0, "NVIDIA H200 SXM", _H200 + " (1,979 sparse)"),
    Peak("h800", 989.0, "NVIDIA H800 SXM", _H100 + " (the H100 SXM's tensor cores)"),
    Peak("h100", 989.0, "NVIDIA H100 SXM", _H100 + " (1,979 sparse)"),
    Peak("a100", 312.0, "NVIDIA A100 (SXM and PCIe)", _A100),
    Peak("a800", 312.0, "NVIDIA A800", _A100 + " (the A100's tensor cores)"),
    Peak("l40s", 362.0, "NVIDIA L40S",
         "NVIDIA L40S datasheet (nvidia.com/en-us/data-center/l40s): BF16 Tensor Core 733 sparse / 2"),
    Peak("mi300x", 1307.4, "AMD Instinct MI300X",
         "AMD Instinct MI300X datasheet (amd.com/en/products/accelerators/instinct/mi300/mi300x.html): "
         "peak BF16 1,307.4 TFLOPS dense"),
    # JAX reports v5e as "TPU v5 lite", v5p as "TPU v5" (or "TPU v5p"), v6e (Trillium) as "TPU v6 lite".
    Peak("tpu v5 lite", 197.0, "Google TPU v5e", _V5E),
    Peak("tpu v5e", 197.0, "Google TPU v5e", _V5E),
    Peak("tpu v5", 459.0, "Google TPU v5p", "Cloud TPU v5p docs (cloud.google.com/tpu/docs/v5p): 459 TFLOPS bf16/chip"),
    Peak("tpu v6 lite", 918.0, "Google TPU v6e (Trillium)", _V6E),
    Peak("tpu v6e", 918.0, "Google TPU v6e (Trillium)", _V6E),
    Peak("tpu v4", 275.0, "Google TPU v4", "Cloud TPU v4 docs (cloud.google.com/tpu/docs/v4): 275 TFLOPS bf16/chip"),
)


def lookup(device_kind: str | None) -> Peak | None:
    """The table's entry for a device kind as JAX or torch report it, or None when it has none."""
    if not isinstance(device_kind, str):
        return None
    kind = device_kind.lower()
    for peak in PEAKS:
        if peak.match in kind:
            return peak
    return None
