"""psgrad: sharded gRPC parameter servers and workers for data-parallel PyTorch training."""
from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# gRPC's fork handlers (grpcio >= 1.80, on by default) restart its poller thread in a child that
# fork() makes while channels or servers are busy; subprocess then closes that poller's epoll
# descriptor before exec, and the child aborts ("epoll_wait error: Bad file descriptor") before it
# runs anything (grpc/grpc#43055). psgrad's processes never use gRPC across a fork without exec,
# so they turn the handlers off before gRPC starts (an explicit setting by the user wins).
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

from psgrad.config import AuthConfig, ClientConfig, JobSpec, ServerConfig, TlsConfig, WorkerConfig  # noqa: E402
from psgrad.errors import (  # noqa: E402
    CompressionWarning,
    ConfigError,
    InvalidRequestError,
    JobMismatchError,
    NotInitializedError,
    PsgradError,
    ServerStartError,
    ServerUnavailableError,
    StalledError,
    TaskError,
    UnknownWorkerError,
    EvictedError,
    SupersededError,
    WorkerStateError,
    CheckpointError,
    AuthenticationError,
    PermissionDeniedError,
)

if TYPE_CHECKING:
    from psgrad.api import PSOptimizer, Session, StepStats, connect, serve
    from psgrad.client.export import ModelSnapshot, fetch_model, fetch_state_dict
    from psgrad.core.optimizer_settings import SGD, Adadelta, Adagrad, Adam, RMSprop
    from psgrad.tasks.base import Task
    from psgrad.tasks.data import ShardedSampler
    from psgrad.nn.embedding import Embedding, EmbeddingBag, clip_grad_norm_
    from psgrad.nn.collection import EmbeddingBagCollection
    from psgrad.core.cores import bind_cores

# The training API pulls in torch and grpc; load it on first use so that `psgrad --help` and
# `import psgrad.config` stay fast.
_LAZY = {
    "connect": "psgrad.api",
    "serve": "psgrad.api",
    "Session": "psgrad.api",
    "PSOptimizer": "psgrad.api",
    "StepStats": "psgrad.api",
    "SGD": "psgrad.core.optimizer_settings",
    "Adam": "psgrad.core.optimizer_settings",
    "Adagrad": "psgrad.core.optimizer_settings",
    "RMSprop": "psgrad.core.optimizer_settings",
    "Adadelta": "psgrad.core.optimizer_settings",
    "Task": "psgrad.tasks.base",
    "fetch_state_dict": "psgrad.client.export",
    "fetch_model": "psgrad.client.export",
    "ModelSnapshot": "psgrad.client.export",
    "ShardedSampler": "psgrad.tasks.data",
    "Embedding": "psgrad.nn.embedding",
    "EmbeddingBag": "psgrad.nn.embedding",
    "EmbeddingBagCollection": "psgrad.nn.collection",
    "clip_grad_norm_": "psgrad.nn.embedding",
    "bind_cores": "psgrad.core.cores",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'psgrad' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value

__all__ = [
    "__version__",
    "connect",
    "serve",
    "Session",
    "PSOptimizer",
    "StepStats",
    "SGD",
    "Adam",
    "Adagrad",
    "RMSprop",
    "Adadelta",
    "Task",
    "fetch_state_dict",
    "fetch_model",
    "ModelSnapshot",
    "ShardedSampler",
    "Embedding",
    "EmbeddingBag",
    "EmbeddingBagCollection",
    "clip_grad_norm_",
    "bind_cores",
    "ClientConfig",
    "TlsConfig",
    "AuthConfig",
    "JobSpec",
    "ServerConfig",
    "WorkerConfig",
    "CompressionWarning",
    "ConfigError",
    "InvalidRequestError",
    "JobMismatchError",
    "NotInitializedError",
    "PsgradError",
    "ServerStartError",
    "ServerUnavailableError",
    "StalledError",
    "TaskError",
    "UnknownWorkerError",
    "EvictedError",
    "SupersededError",
    "WorkerStateError",
    "CheckpointError",
    "AuthenticationError",
    "PermissionDeniedError",
]
