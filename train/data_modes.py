"""``train.data_mode`` → the :class:`~train.features.FeatureSource` that serves it: the one place the mode is read.

It sits above every source (offline and online in :mod:`train.features`, streamed in :mod:`train.streaming`), so
the streamed source can build on the shared pieces of ``train.features`` without ``train.features`` importing it
back (issue 30). A new mode is a new source plus one entry here; the trainer holds no mode branch.
"""

from __future__ import annotations

from typing import Any

from train.features import FeatureSource, OfflineFeatures, OnlineFeatures, RowLayout
from train.settings import TrainSettings
from train.streaming import StreamFeatures

SOURCES: dict[str, type[FeatureSource]] = {
    "offline": OfflineFeatures,
    "online": OnlineFeatures,
    "stream": StreamFeatures,
    "cache-first-epoch": StreamFeatures,
}


def open_features(
    settings: TrainSettings, accelerator: Any, layout: RowLayout, verifier_config: dict[str, Any]
) -> FeatureSource:
    """The run's feature source for ``train.data_mode`` (already validated against ``DATA_MODES``)."""
    return SOURCES[settings.train.data_mode](settings, accelerator, layout, verifier_config)


__all__ = ["SOURCES", "open_features"]
