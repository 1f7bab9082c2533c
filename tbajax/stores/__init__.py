"""Run-directory stores shared by separate processes: trajectories (searchers -> trainer) and
versioned params (trainer -> searchers). Local paths, ``file://``, ``gs://`` and ``s3://`` URLs."""

from tbajax.stores.params import (
    ParamPublisher,
    ParamReader,
    ParamStoreError,
    ParamVersionError,
    PublishedVersion,
    abstract_target,
    cast_floating,
)
from tbajax.stores.trajectories import (
    TrajectoryReader,
    TrajectoryStoreError,
    TrajectoryWriter,
    discover_searcher_stores,
)
from tbajax.stores.urls import param_store_url, to_url, trajectory_store_url

__all__ = [
    "ParamPublisher",
    "ParamReader",
    "ParamStoreError",
    "ParamVersionError",
    "PublishedVersion",
    "TrajectoryReader",
    "TrajectoryStoreError",
    "TrajectoryWriter",
    "abstract_target",
    "cast_floating",
    "discover_searcher_stores",
    "param_store_url",
    "to_url",
    "trajectory_store_url",
]
