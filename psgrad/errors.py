"""psgrad's exception family; gRPC status codes are attached only at the server/client edge."""
from __future__ import annotations


class PsgradError(Exception):
    """Base class of every error psgrad raises on purpose."""


class ConfigError(PsgradError, ValueError):
    """A configuration value or command-line argument is invalid."""


class ServerUnavailableError(PsgradError):
    """A parameter server could not be reached or did not answer in time."""


class DeadlineExceededError(ServerUnavailableError):
    """A call got no answer before its deadline (the server may still be reachable: busy, paused,
    or holding the call)."""


class ServerStartError(PsgradError):
    """A parameter server could not start (for example its port is taken)."""


class InvalidRequestError(PsgradError):
    """A request is malformed: wrong payload size, dtype, or a non-finite gradient."""


class NonFiniteGradientError(InvalidRequestError):
    """A pushed gradient holds NaN or inf values (refused under --nonfinite reject)."""


class NotInitializedError(PsgradError):
    """A shard was used before the chief (rank 0) initialized it."""


class JobMismatchError(PsgradError):
    """A worker's model or job spec differs from the one the shard was initialized with."""


class WorkerStateError(PsgradError):
    """A worker's call does not fit its membership state (e.g. it already left the job)."""


class UnknownWorkerError(WorkerStateError):
    """A shard does not know the worker: it never joined, or the shard restarted from a checkpoint
    taken before it joined (the client then joins again by itself)."""


class EvictedError(WorkerStateError):
    """A shard evicted the worker: no call of its reached the shard within its lease (a network
    partition, a paused process, a host too busy). The Python API joins again by itself and
    continues from the job's current clock."""


class SupersededError(WorkerStateError):
    """Another worker process joined as this worker's rank since (a second process started with
    the same rank, or this one was taken for dead and restarted): the shards refuse this one's
    pushes and heartbeats from then on, rather than take two processes' steps as one worker's.
    Not retried: give each worker process its own rank."""


class StalledError(PsgradError):
    """A pull waited for other workers (sync/ssp gate) until its deadline passed."""


class RollbackError(PsgradError):
    """Sync mode: a shard is behind the job's iteration (it was restored from a checkpoint), so the
    job must roll back to an iteration every shard can return to. The worker's client does that by
    itself; the error reaches a caller only when the roll-back cannot be done."""


class NotPrimaryError(PsgradError):
    """This server does not serve workers now: a backup still waiting for its primary's state, or
    a former primary fenced by its promoted backup (the worker then tries the shard's other server)."""


class StaleEpochError(PsgradError):
    """A replication message from an older epoch: its sender was replaced by a promoted backup."""


class AuthenticationError(PsgradError):
    """A call carried no credential the server accepts (none, a malformed one, or another job's)."""


class PermissionDeniedError(PsgradError):
    """A call's credential is valid but does not allow it (worker 1 acting as rank 0, a worker
    initializing the job, anyone but a server replicating)."""


class ServerBusyError(PsgradError):
    """The server refused a call for now (too many pushes or other client streams open, in all or from
    one connection): the caller should try again after a pause (workers do, within
    --reconnect-timeout-s)."""


class ApplyFailedError(PsgradError):
    """An update failed while it was being applied on the server (an internal error, not the
    push's fault): what it wrote was undone and its retry applies it once, or, where that could
    not be done exactly, the shard refuses every push from then on (it must be restarted from its
    checkpoint, or its standby take over) instead of applying part of an update twice."""


class MemoryBudgetError(PsgradError):
    """A sparse table would grow past the server's memory budget (--memory-budget-mb)."""


class TaskError(PsgradError):
    """A training task could not be found, imported or built."""


class CheckpointError(PsgradError):
    """A checkpoint could not be written, or none that could be read was found."""


class CompressionWarning(UserWarning):
    """A job's `compress` codec leaves some pushes plain: those to shards on this host, which
    travel through shared memory (`ClientConfig(compress_same_host=True)` compresses them too)."""


# Name -> class, so the client can re-raise the exact error the server raised.
ERRORS_BY_NAME: dict[str, type[PsgradError]] = {
    cls.__name__: cls
    for cls in (
        PsgradError,
        ConfigError,
        ServerUnavailableError,
        DeadlineExceededError,
        ServerStartError,
        InvalidRequestError,
        NonFiniteGradientError,
        NotInitializedError,
        JobMismatchError,
        WorkerStateError,
        UnknownWorkerError,
        EvictedError,
        SupersededError,
        StalledError,
        RollbackError,
        NotPrimaryError,
        StaleEpochError,
        AuthenticationError,
        PermissionDeniedError,
        ServerBusyError,
        ApplyFailedError,
        MemoryBudgetError,
        TaskError,
        CheckpointError,
    )
}


class Terminated(KeyboardInterrupt):
    """A worker's SIGTERM (a scheduler's stop: `scancel`, a pod deleted, a launcher ending the job),
    raised in its main thread: it stops as Ctrl-C stops it (it leaves the job, saying goodbye to each
    shard once), and the command exits 143."""
