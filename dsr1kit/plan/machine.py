"""What one node offers: the machine a memory plan is checked against."""

from __future__ import annotations

from dataclasses import dataclass, replace

from .devices import GIB


@dataclass(frozen=True)
class Machine:
    """What one node offers: GPUs, bytes per GPU, host bytes available."""

    gpus: int
    gpu_bytes: float
    host_bytes: float
    label: str = "this node"

    @classmethod
    def detect(cls) -> "Machine":
        """This node as torch sees it (GPU count and size) and the host memory available now."""
        import psutil
        import torch

        gpus = torch.cuda.device_count()
        gpu_bytes = torch.cuda.get_device_properties(0).total_memory if gpus else 0.0
        return cls(gpus, float(gpu_bytes), float(psutil.virtual_memory().available))

    def with_overrides(
        self, gpus: int | None = None, gpu_gib: float | None = None, host_gib: float | None = None
    ) -> "Machine":
        changed = {
            k: v
            for k, v in (
                ("gpus", gpus),
                ("gpu_bytes", gpu_gib and gpu_gib * GIB),
                ("host_bytes", host_gib and host_gib * GIB),
            )
            if v is not None
        }
        return replace(self, **changed, label="as given") if changed else self

    def describe(self) -> str:
        gpus = f"{self.gpus} GPU(s) of {self.gpu_bytes / GIB:.1f} GiB" if self.gpus else "no GPU"
        return f"{self.label}: {gpus}, {self.host_bytes / GIB:.1f} GiB host memory available"
