"""The two published weight-update tables, cell for cell as printed, with the inputs each one states.

Facts, kept as data: every cell is the published text, so a figure reads exactly as it was printed;
published.py parses the cells and recomputes each figure from the stated inputs. `model` is the
catalog name (`wsync plan models`) a row is about, `lora` its adapter as (layout, rank), else None.
"""
from __future__ import annotations

from typing import NamedTuple

SOURCE = '"Reinforcement learning is an infrastructure problem" (Modal)'


class Row(NamedTuple):
    model: str
    lora: tuple[str, int] | None
    cells: tuple[str, ...]


# Table 1: in-cluster weight update, NCCL over TCP vs over RDMA.
IN_CLUSTER_TITLE = "in-cluster weight update, NCCL over TCP vs over RDMA"
IN_CLUSTER_INPUTS = {"tcp_gbit_per_s": "50", "rdma_gbit_per_s": "3200", "usd_per_gpu_s": "0.01"}
IN_CLUSTER_COLUMNS = ("Model", "Size of weight update", "NCCL over TCP", "NCCL over RDMA", "Reference GPU count",
                      "Estimated cost savings per training step")
IN_CLUSTER = (
    Row("qwen3-8b", None, ("Qwen3 8B", "16.3 GB (BF16)", "2.62 s", "41 ms", "1x8 H100", "$0.21")),
    Row("qwen3-30b-a3b", None, ("Qwen3-30B-A3B", "61.1 GB (BF16)", "9.78 s", "153 ms", "1x8 H100", "$0.77")),
    Row("qwen3-30b-a3b", ("shared-outer", 32),
        ("Qwen3-30B-A3B LoRA (r=32, shared-outer)", "1.0 GB (BF16)", "160 ms", "2.5 ms", "1x8 H100", "$0.013")),
    Row("glm-4.7", None, ("GLM 4.7", "716.7 GB (BF16)", "114.67 s", "1.79 s", "4x8 B200", "$36.12")),
    Row("glm-4.7", ("shared-outer", 32),
        ("GLM-4.7 LoRA (r=32, shared-outer)", "4.7 GB (BF16)", "752 ms", "11.75 ms", "4x8 B200", "$0.24")),
    Row("glm-4.7", ("per-expert", 32),
        ("GLM-4.7 LoRA (r=32, per-expert)", "18.8 GB (BF16)", "3.01 s", "47 ms", "4x8 B200", "$0.95")),
    Row("kimi-k2.6", None,
        ("Kimi 2.6", "595.2 GB (INT4 MoE / BF16 attn)", "95.23 s", "1.49 s", "16x8 H200", "$119.99")),
    Row("kimi-k2.6", ("shared-outer", 32),
        ("Kimi 2.6 LoRA (r=32, shared-outer)", "9.4 GB (BF16)", "1.50 s", "23.5 ms", "16x8 H200", "$1.90")),
    Row("kimi-k2.6", ("per-expert", 32),
        ("Kimi 2.6 LoRA (r=32, per-expert)", "41.0 GB (BF16)", "6.56 s", "102.5 ms", "16x8 H200", "$8.27")),
)

# Table 2: disaggregated RL over a WAN, full weights vs delta compression.
WAN_TITLE = "disaggregated RL over a WAN, full weights vs delta compression"
WAN_INPUTS = {"wan_gbit_per_s": "10", "delta_saving": "0.98"}
WAN_COLUMNS = ("Model", "Size", "Full weights transfer time", "Delta compression")
WAN = (
    Row("qwen3-8b", None, ("Qwen3 8B", "16 GB (BF16)", "12.8 s", "0.26 s")),
    Row("qwen3-30b-a3b", None, ("Qwen3 30B-A3B", "60 GB (BF16)", "48 s", "0.96 s")),
    Row("glm-4.7", None, ("GLM 4.7 (~355B)", "357 GB (BF16)", "285.6 s", "5.73 s")),
    Row("kimi-k2.6", None, ("Kimi K2.6 (~1T)", "595.2 GB (INT4, MoE / BF16 attn)", "480 s", "9.6 s")),
)
