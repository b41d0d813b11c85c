"""Export, conversion and publishing: trainer checkpoints and other projects' EAGLE-3 layouts become standard
speculators directories that vLLM serves as they are, validated before they are written, and pushed to the Hub.
"""

from speculators.export.convert import LAYOUTS, UnsupportedDraftError, convert_checkpoint, detect_layout
from speculators.export.exporter import ExportResult, export_checkpoint
from speculators.export.hub import push_checkpoint
from speculators.export.tensors import ExportWarning
from speculators.export.writer import InvalidCheckpointError
from speculators.runs import TrainerCheckpoint, locate_checkpoint

__all__ = [
    "LAYOUTS",
    "ExportResult",
    "ExportWarning",
    "InvalidCheckpointError",
    "TrainerCheckpoint",
    "UnsupportedDraftError",
    "convert_checkpoint",
    "detect_layout",
    "export_checkpoint",
    "locate_checkpoint",
    "push_checkpoint",
]
