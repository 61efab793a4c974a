"""The GPU table's entry for a device's own name (`torch.cuda.get_device_name()`), which MFU's peak and
the planner on that machine read: a name that is another card gets no entry, never a wrong one."""

from __future__ import annotations

import pytest

from shardtune.hardware import gpu_by_device_name

# names as torch reports them (nvidia-smi's), and the table's card or None
NAMES = {
    "NVIDIA H100 80GB HBM3": "H100", "NVIDIA H100 PCIe": None, "NVIDIA H100 NVL": None,
    "NVIDIA H200": "H200", "NVIDIA H200 NVL": None, "NVIDIA GH200 480GB": "H200",
    "NVIDIA H800": "H800", "NVIDIA H800 PCIe": None,
    "NVIDIA A100-SXM4-80GB": "A100-80GB", "NVIDIA A100 80GB PCIe": "A100-80GB-PCIe",
    "NVIDIA A100-SXM4-40GB": "A100-40GB", "NVIDIA A100-PCIE-40GB": "A100-40GB", "NVIDIA A800-SXM4-80GB": None,
    "NVIDIA L40S": "L40S", "NVIDIA L40": None, "NVIDIA L4": "L4",
    "NVIDIA A10G": "A10G", "NVIDIA A10": "A10", "NVIDIA A40": None,
    "NVIDIA GeForce RTX 4090": "RTX-4090", "NVIDIA GeForce RTX 4090 D": None,
    "NVIDIA GeForce RTX 4090 Laptop GPU": None, "NVIDIA GeForce RTX 3090": "RTX-3090",
    "NVIDIA GeForce RTX 3090 Ti": None, "NVIDIA RTX A6000": "A6000", "NVIDIA RTX 6000 Ada Generation": None,
    "Tesla V100-SXM2-32GB": "V100-32GB", "Tesla V100-SXM2-16GB": "V100-16GB", "Tesla V100-PCIE-32GB": None,
    "Tesla V100S-PCIE-32GB": None, "Tesla T4": "T4", "NVIDIA T400 4GB": None, "NVIDIA T1000": None,
    # a MIG slice has a share of the card's units: the whole card's peak put its MFU 2-7x low
    "NVIDIA A100-SXM4-40GB MIG 3g.20gb": None, "NVIDIA H100 80GB HBM3 MIG 1g.10gb": None,
}


@pytest.mark.parametrize("device_name", NAMES)
def test_a_device_is_its_own_card_or_none(device_name):
    """An L40 took the L4's peak (MFU 1.5x too high), an H100 PCIe or NVL the SXM board's (-24 %, -16 %)."""
    gpu = gpu_by_device_name(device_name)
    assert (gpu.name if gpu else None) == NAMES[device_name]
