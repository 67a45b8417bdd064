"""A model's synchronized buffers (BatchNorm running statistics and counters) as the float32 tail
of the flat space: what a step pushes is how much they changed since the last pull, and a pull
installs the job's values.

The servers keep the job's buffers after the parameters and add what each push says they moved:
in sync mode the mean of the workers' deltas (each worker's running mean moved from the same
pulled value, so the mean is the average of their running means), in async/ssp mode each delta
divided by the number of workers. Integer buffers (num_batches_tracked) travel as float32 and are
rounded when installed: only those whose values the wire dtype holds exactly when the job starts
are synced here; the others (and bool or complex ones) are kept exactly with the frozen parameters
(core/sharding.py, split_buffers).
"""
from __future__ import annotations

import torch
from torch import nn

from psgrad.core.sharding import synced_buffers
from psgrad.errors import ConfigError


class ModelBuffers:
    """The synchronized buffers of one model: their values, and a snapshot of what was last
    installed (or pushed), against which the next delta is taken."""

    def __init__(self, model: nn.Module, device: torch.device, wire_dtype: str = "float32") -> None:
        self.named = synced_buffers(model, wire_dtype)
        self.numel = sum(b.numel() for _, b in self.named)
        for name, b in self.named:
            if b.device != device:
                raise ConfigError(f"buffer {name} is on {b.device}, the model's parameters on {device}: call model.to(device) first")
        # Float32 copies on the model's device: what the buffers held when last installed or pushed.
        self._snapshot = torch.empty(self.numel, dtype=torch.float32, device=device)
        self._delta = torch.zeros(self.numel, dtype=torch.float32, device=device)
        self._captured = False
        self._read(self._snapshot)

    def _read(self, out: torch.Tensor) -> None:
        """The buffers' current values, as float32, into out (same device)."""
        offset = 0
        for _, b in self.named:
            n = b.numel()
            out[offset : offset + n].copy_(b.reshape(-1))
            offset += n

    def values(self, out: torch.Tensor) -> None:
        """The current values into out (float32, any device): what the chief initializes with."""
        scratch = torch.empty(self.numel, dtype=torch.float32, device=self._snapshot.device)
        self._read(scratch)
        out.copy_(scratch)

    def capture(self) -> None:
        """Take how much the buffers moved since the last install or capture (forward passes in
        training mode), and count it as pushed: the next capture starts from here."""
        current = torch.empty_like(self._snapshot)
        self._read(current)
        if self._captured:  # a second capture before the push: both moves go out
            self._delta.add_(current - self._snapshot)
        else:
            torch.sub(current, self._snapshot, out=self._delta)
        self._snapshot.copy_(current)
        self._captured = True

    def deltas(self, out: torch.Tensor) -> None:
        """The captured deltas (captured now if not yet) into out, for the push."""
        if not self._captured:
            self.capture()
        out.copy_(self._delta)
        self._captured = False

    @torch.no_grad()
    def install(self, src: torch.Tensor) -> None:
        """Make the job's pulled values (float32, any device) the model's buffers."""
        values = src.to(self._snapshot.device, non_blocking=False)
        offset = 0
        for _, b in self.named:
            n = b.numel()
            piece = values[offset : offset + n].view(b.shape)
            b.copy_(piece if b.is_floating_point() else piece.round())
            # what the buffer holds now (rounded for integers), so the next delta counts only new moves
            self._snapshot[offset : offset + n].copy_(b.reshape(-1))
            offset += n
