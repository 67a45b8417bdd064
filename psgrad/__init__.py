"""psgrad: sharded gRPC parameter servers and workers for data-parallel PyTorch training."""
from __future__ import annotations

__version__ = "0.1.0"

from psgrad.config import ClientConfig, JobSpec, ServerConfig, WorkerConfig  # noqa: E402
from psgrad.errors import (  # noqa: E402
    ConfigError,
    InvalidRequestError,
    JobMismatchError,
    NotInitializedError,
    PsgradError,
    ServerStartError,
    ServerUnavailableError,
    StalledError,
    TaskError,
    WorkerStateError,
)

__all__ = [
    "__version__",
    "ClientConfig",
    "JobSpec",
    "ServerConfig",
    "WorkerConfig",
    "ConfigError",
    "InvalidRequestError",
    "JobMismatchError",
    "NotInitializedError",
    "PsgradError",
    "ServerStartError",
    "ServerUnavailableError",
    "StalledError",
    "TaskError",
    "WorkerStateError",
]
