"""Export, conversion and publishing: trainer checkpoints and other projects' EAGLE-3 layouts become standard
speculators directories that vLLM serves as they are, validated before they are written, and pushed to the Hub.
"""

from speculators.export.convert import UnsupportedDraftError, convert_checkpoint, detect_layout, layouts
from speculators.export.exporter import ExportResult, export_checkpoint
from speculators.export.hub import push_checkpoint
from speculators.export.tensors import ExportWarning
from speculators.export.writer import InvalidCheckpointError
from speculators.runs import TrainerCheckpoint, locate_checkpoint

__all__ = [
    "ExportResult",
    "ExportWarning",
    "InvalidCheckpointError",
    "TrainerCheckpoint",
    "UnsupportedDraftError",
    "convert_checkpoint",
    "detect_layout",
    "layouts",
    "export_checkpoint",
    "locate_checkpoint",
    "push_checkpoint",
]


def __getattr__(name: str):  # noqa: ANN202 - ``LAYOUTS``: every unit's convert layouts, computed when asked
    if name == "LAYOUTS":
        return layouts()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
