"""A model's trainable parameters and gradients as flat buffers, and their copies to and from the host.

The servers see one float32 vector (the flat space, `named_parameters()` order, then with
sync_buffers the model's persistent buffers: see model_buffers.py). On the worker,
every parameter becomes a view of one flat device buffer per dtype, and its gradient a view of a
matching flat gradient buffer, so backward accumulates straight into the buffer that is pushed.
Moving a step's data then costs at most one copy each way:

- CPU, float32, no staging: the host buffers *are* the model's buffers (zero copies).
- CUDA: pinned host buffers, one `non_blocking` device->host copy of the gradient per push and one
  host->device copy of the weights per pull.
- bfloat16/float16 (or mixed) parameters: a float32 conversion on the device, then the same copy;
  the servers keep float32 master weights.
- staging=True (needed when communication overlaps computation): separate host buffers even on
  CPU, so a background push/pull never touches the tensors autograd is using.

Every buffer is allocated once, here; a step allocates nothing large.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from psgrad.core.unused import Ranges, merged
from psgrad.errors import ConfigError
from psgrad.worker.model_buffers import ModelBuffers


def resolve_device(name: str, local_rank: int | None = None) -> torch.device:
    """'auto' -> cuda when available (cuda:(local_rank mod GPUs) given the worker's index on its
    host, so each worker of a host takes its own GPU), else cpu; 'cuda[:N]' must exist."""
    if name == "auto":
        if not torch.cuda.is_available():
            return torch.device("cpu")
        return torch.device("cuda", (local_rank or 0) % max(1, torch.cuda.device_count()))
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"invalid device {name!r}; valid: auto, cpu, cuda, cuda:N") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ConfigError(f"device {name!r} requested but torch sees no CUDA device")
        if device.index is not None and device.index >= count:
            raise ConfigError(f"device {name!r} requested but only {count} CUDA device(s) exist")
    elif device.type != "cpu":
        raise ConfigError(f"unsupported device {name!r}; valid: auto, cpu, cuda, cuda:N")
    return device


@dataclass
class _Segment:
    """One parameter: its views in its dtype group's buffers and its place in the flat space."""

    param: nn.Parameter
    grad: torch.Tensor  # view of the group's flat gradient buffer
    start: int  # offset in the float32 flat space
    numel: int


class FlatModel:
    """Flat parameter/gradient buffers for one model, plus host staging buffers when needed.

    Attributes:
        flat, grad: the device buffers when every parameter has the same dtype (that dtype);
            None for a model that mixes dtypes.
        host_flat, host_grad: float32 CPU tensors of the whole flat space: pulls write into
            host_flat, pushes read host_grad. Pinned on CUDA. With synchronized buffers their
            last `buffers.numel` elements are the buffers' values (pulled) and deltas (pushed).
        numel: trainable elements; total: the flat space's (numel plus the buffers').
        d2h_s, h2d_s: the time the last gather_grads / weights_pulled spent copying.
    Frozen parameters (requires_grad=False) are not in the flat space: the servers keep them in a
    table of their own (see PSOptimizer), or each worker does (frozen="local"). tables: the model
    has psgrad embedding tables, which may be its only trainable weights (a matrix factorization):
    its flat space is then empty (float32, on the CPU), where a model without either is refused.
    wire_dtype: the job's, which decides the buffers the flat space syncs (those whose values it
    holds exactly; see core/sharding.py, split_buffers).
    """

    def __init__(
        self, model: nn.Module, device: torch.device | None = None, staging: bool = False, sync_buffers: bool = False,
        tables: bool = False, wire_dtype: str = "float32",
    ) -> None:
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params and not tables:
            raise ConfigError("the model has no trainable parameters (requires_grad=True)")
        devices = {p.device for p in self.params} or {torch.device("cpu")}  # (tables alone: an empty flat space)
        if len(devices) != 1:
            raise ConfigError(
                f"the model's parameters are spread over {sorted(map(str, devices))}; psgrad needs them on one device"
            )
        (found,) = devices
        if device is not None and found != device and not (found.type == device.type and device.index is None):
            raise ConfigError(f"the model is on {found} but device {device} was requested: call model.to(device) first")
        self.device = found
        for p in self.params:
            if not p.is_floating_point():
                raise ConfigError(f"parameters must be floating point, got {p.dtype}")
        self.dtypes = list(dict.fromkeys(p.dtype for p in self.params)) or [torch.float32]
        self.numel = sum(p.numel() for p in self.params)
        self.buffers = ModelBuffers(model, self.device, wire_dtype) if sync_buffers else None
        if self.buffers is not None and self.buffers.numel == 0:
            self.buffers = None
        tail = self.buffers.numel if self.buffers is not None else 0
        self.total = self.numel + tail
        self.d2h_s = 0.0
        self.h2d_s = 0.0
        self._segments: list[_Segment] = []
        self._groups: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}
        self._plain = self.dtypes == [torch.float32]  # device buffers are already the float32 flat space
        cuda = self.device.type == "cuda"
        zero_copy = self._plain and not cuda and not staging
        # Zero copies: the host buffers are the model's own, with room for the buffers' tail.
        self._build_groups(tail if zero_copy else 0)
        uniform = len(self.dtypes) == 1
        first_flat, first_grad = self._groups[self.dtypes[0]]
        if zero_copy and tail:  # the parameters' part; the tail is the buffers'
            first_flat, first_grad = first_flat[: self.numel], first_grad[: self.numel]
        self.flat = first_flat if uniform else None
        self.grad = first_grad if uniform else None
        if zero_copy:
            self.host_flat, self.host_grad = self._groups[torch.float32]
        else:
            self.host_flat = torch.empty(self.total, dtype=torch.float32, pin_memory=cuda)
            self.host_grad = torch.empty(self.total, dtype=torch.float32, pin_memory=cuda)
        # float32 conversion buffers on the device, for non-float32 models on CUDA
        self._dev_flat32: torch.Tensor | None = None
        self._dev_grad32: torch.Tensor | None = None
        if cuda and not self._plain:
            self._dev_flat32 = torch.empty(self.numel, dtype=torch.float32, device=self.device)
            self._dev_grad32 = torch.empty(self.numel, dtype=torch.float32, device=self.device)
        self.staged = not zero_copy
        self._lent = False  # some parameters are views of versions lent read-only (weights_pulled)
        self._names = {id(p): name for name, p in model.named_parameters()}
        self._installed: list[int] = []  # each parameter's version counter when psgrad last wrote it
        self._storage: list[int] = []  # each parameter's data_ptr() then: another one, new memory
        self._layout = [(p.dtype, p.device) for p in self.params]
        self._places: list[tuple[Mapping[str, object], str, object]] = []
        self._record_places()
        self.mark_installed()
        # Which parameters a backward reached since the last push (or zero_grad): a flag each, set
        # by a hook autograd calls once it accumulated a parameter's gradient. The others are the
        # step's unused parameters (torch leaves their .grad None): see gather_grads.
        self._reached = [False] * len(self._segments)
        self._gathered = False  # a gather took the flags, and no backward or zero_grad came since
        #: the last gather_grads' unused parameters, as ranges of the flat space (core/unused.py)
        self.unused: Ranges = ()
        for i, seg in enumerate(self._segments):
            seg.param.register_post_accumulate_grad_hook(self._reached_hook(i))

    def _reached_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def reached(_: torch.Tensor) -> None:
            self._reached[index] = True
        return reached

    def _record_places(self) -> None:
        """Where each module and trainable parameter sits in the model, to see one replaced (a new
        nn.Parameter, or a module swapped in) at a dict lookup each: (the parent's dict, key, object)."""
        tracked = {id(p) for p in self.params}
        self._places = []
        for module in self.model.modules():
            self._places += [(module._modules, key, child) for key, child in module._modules.items()]
            self._places += [(module._parameters, key, p) for key, p in module._parameters.items()
                             if p is not None and id(p) in tracked]

    def _build_groups(self, tail: int) -> None:
        """Allocate one (weights, grads) buffer pair per dtype (the first with `tail` elements more)
        and turn parameters into views of it."""
        offset = 0
        group_fill: dict[torch.dtype, int] = {}
        for dtype in self.dtypes:
            n = sum(p.numel() for p in self.params if p.dtype == dtype) + (tail if dtype == self.dtypes[0] else 0)
            self._groups[dtype] = (
                torch.empty(n, dtype=dtype, device=self.device),
                torch.zeros(n, dtype=dtype, device=self.device),
            )
            group_fill[dtype] = 0
        with torch.no_grad():
            for p in self.params:
                flat, grad = self._groups[p.dtype]
                at, n = group_fill[p.dtype], p.numel()
                view = flat[at : at + n].view_as(p)
                view.copy_(p)
                p.data = view
                gview = grad[at : at + n].view_as(p)
                p.grad = gview
                self._segments.append(_Segment(p, gview, offset, n))
                group_fill[p.dtype] = at + n
                offset += n

    # ------------------------------------------------------------------ gradients
    def zero_grad(self) -> None:
        self._reached = [False] * len(self._segments)
        self._gathered = False
        for _, grad in self._groups.values():
            grad.zero_()
        for seg in self._segments:  # re-attach if user code replaced .grad (e.g. set_to_none)
            if seg.param.grad is not seg.grad:
                seg.param.grad = seg.grad

    def collect_grads(self) -> None:
        """Make sure every parameter's gradient is in the flat gradient buffers."""
        for seg in self._segments:
            if seg.param.grad is not seg.grad:  # autograd or the user replaced the view: copy instead
                if seg.param.grad is None:
                    seg.grad.zero_()
                else:
                    seg.grad.copy_(seg.param.grad)
                seg.param.grad = seg.grad

    def capture_buffers(self) -> None:
        """Take the buffers' moves since the last pull now (before weights pulled in the
        background replace them); the next gather_grads pushes them."""
        if self.buffers is not None:
            self.buffers.capture()

    def _to_float32(self, dest: torch.Tensor) -> None:
        """Write the flat gradient, converted to float32, into dest (same device)."""
        if len(self.dtypes) == 1:
            assert self.grad is not None
            dest.copy_(self.grad)
            return
        for seg in self._segments:
            dest[seg.start : seg.start + seg.numel].copy_(seg.grad.reshape(-1))

    def find_unused(self) -> Ranges:
        """The parameters this step left unused, as flat ranges: no backward reached them since
        the last push or zero_grad, and their .grad is None or psgrad's view holding only zeros
        (a gradient written by hand, into the view or as a tensor of its own, counts as used, as
        a stale one a step did not zero does). Their gradient is pushed as zeros and the servers
        leave them alone, as torch.optim skips a parameter whose .grad is None. Call before
        collect_grads (which attaches the views again). Clears the flags; gathered again with no
        backward or zero_grad since (a step taken again after it raised), the same answer."""
        if self._gathered and not any(self._reached):
            return self.unused
        reached, self._reached = self._reached, [False] * len(self._segments)
        self._gathered = True
        if all(reached):  # (the common step: every parameter used)
            return ()
        out = []
        for seg, hit in zip(self._segments, reached):
            if hit:
                continue
            grad = seg.param.grad
            if grad is None or (grad is seg.grad and not bool(grad.any())):
                out.append((seg.start, seg.start + seg.numel))
        return merged(out)

    def gather_grads(self) -> torch.Tensor:
        """The flat float32 gradient on the host (and the buffers' deltas after it), ready to push
        (host_grad); `unused` names the parameters the step left unused (find_unused)."""
        self.unused = self.find_unused()
        self.collect_grads()
        if self.buffers is not None:
            self.buffers.deltas(self.host_grad[self.numel :])
        if not self.staged:
            self.d2h_s = 0.0
            return self.host_grad
        grads = self.host_grad[: self.numel]
        if self.device.type == "cuda":
            stream = torch.cuda.current_stream(self.device)
            stream.synchronize()  # backward has finished: what follows is the copy alone
            t0 = time.perf_counter()
            if self._dev_grad32 is not None:
                self._to_float32(self._dev_grad32)
                src = self._dev_grad32
            else:
                assert self.grad is not None
                src = self.grad
            grads.copy_(src, non_blocking=True)
            stream.synchronize()
        else:
            t0 = time.perf_counter()
            self._to_float32(grads)
        self.d2h_s = time.perf_counter() - t0
        return self.host_grad

    # ------------------------------------------------------------------ weights
    def _from_float32(self, src: torch.Tensor) -> None:
        """Write float32 flat weights src (same device) into the parameters, converting dtype."""
        with torch.no_grad():
            if len(self.dtypes) == 1:
                assert self.flat is not None
                self.flat.copy_(src)
                return
            for seg in self._segments:
                seg.param.view(-1).copy_(src[seg.start : seg.start + seg.numel])

    @property
    def zero_copy(self) -> bool:
        """Whether pulled versions can be the model's parameters in place (CPU, float32, no staging)."""
        return not self.staged

    def adopt_grad_buffer(self, buf: torch.Tensor) -> None:
        """Make buf (float32, the flat space's size: shared memory a push is not copied from) the
        flat gradient buffer: every parameter's .grad becomes a view of it (unstaged only)."""
        assert not self.staged and buf.numel() == self.total and buf.dtype == torch.float32
        buf.copy_(self.host_grad)
        flat, _ = self._groups[torch.float32]
        self._groups[torch.float32] = (flat, buf)
        self.host_grad = buf
        self.grad = buf[: self.numel]
        for seg in self._segments:
            seg.grad = buf[seg.start : seg.start + seg.numel].view_as(seg.param)
            seg.param.grad = seg.grad

    def weights_pulled(self, views: Sequence[tuple[int, torch.Tensor | None]] = ()) -> None:
        """Move freshly pulled weights from host_flat into the model (no-op when they are the same buffer).

        views (unstaged only): per shard, its start in the flat space and the version a same-host
        server lent read-only (None: that range was written into host_flat). Parameters inside a
        lent range become views of it (a pointer swap, no copy); the others, views of host_flat.
        On CUDA this waits for the copy, so host_flat may be overwritten by the next pull right after.
        Synchronized buffers take the pulled values too.
        """
        if not self.staged and (any(v is not None for _, v in views) or self._lent):  # (else they view host_flat)
            self._point_params(views)
        if self.buffers is not None:
            self.buffers.install(self._read(self.numel, self.total, views))
        if not self.staged:
            self.h2d_s = 0.0
            self.mark_installed()
            return
        t0 = time.perf_counter()
        weights = self.host_flat[: self.numel]
        if self.device.type == "cuda":
            if self._dev_flat32 is not None:
                self._dev_flat32.copy_(weights, non_blocking=True)
                self._from_float32(self._dev_flat32)
            else:
                assert self.flat is not None
                self.flat.copy_(weights, non_blocking=True)
            torch.cuda.current_stream(self.device).synchronize()
        else:
            self._from_float32(weights)
        self.h2d_s = time.perf_counter() - t0
        self.mark_installed()

    def mark_installed(self) -> None:
        """Remember each parameter's version counter and memory: the weights in it are the job's."""
        self._installed = [seg.param._version for seg in self._segments]
        self._storage = [seg.param.data_ptr() for seg in self._segments]

    def detached(self) -> str | None:
        """What took a parameter out of the flat buffers since the job's weights were installed
        (model.double(), .half(), .to(another device), a tensor given to its .data, a new
        nn.Parameter or module in its place), as "parameter 'name' ...", or None. Pulls would no
        longer reach the model, nor its gradients the pushes."""
        if [seg.param.data_ptr() for seg in self._segments] == self._storage:  # (the common case, at once)
            return self._replaced()
        for seg, ptr, (dtype, device) in zip(self._segments, self._storage, self._layout):
            p = seg.param
            if p.data_ptr() != ptr:
                name = self._names.get(id(p), "?")
                if p.dtype != dtype:
                    return f"parameter {name!r} became {p.dtype} (was {dtype})"
                if p.device != device:
                    return f"parameter {name!r} moved to {p.device} (was on {device})"
                return f"parameter {name!r} holds another tensor (one given to its .data)"
        return self._replaced()

    def _replaced(self) -> str | None:
        """detached()'s part for a parameter replaced in the model (or None)."""
        for parent, key, obj in self._places:
            if parent.get(key) is not obj:
                break
        else:
            return None
        present = {id(p) for p in self.model.parameters()}
        gone = next((seg.param for seg in self._segments if id(seg.param) not in present), None)
        if gone is None:  # a module without trainable parameters swapped (nn.ReLU for nn.GELU): no matter
            self._record_places()
            return None
        return f"parameter {self._names.get(id(gone), '?')!r} was replaced (a new nn.Parameter or module)"

    def edited_in_place(self) -> str | None:
        """The name of a parameter written in place since the job's weights were installed
        (load_state_dict, nn.init, an in-place op under no_grad), or None. Autograd's version
        counter tells, at no cost; psgrad's own installs do not move it."""
        for seg, version in zip(self._segments, self._installed):
            if seg.param._version != version:
                return self._names.get(id(seg.param), "?")
        return None

    def _read(self, start: int, end: int, views: Sequence[tuple[int, torch.Tensor | None]]) -> torch.Tensor:
        """The pulled values of [start, end): a lent view where one shard's range holds them, else
        host_flat (with the lent parts of a range that spans shards copied in)."""
        ends = [*[b for b, _ in views[1:]], self.total]
        for (begin, view), nxt in zip(views, ends):
            if view is not None and begin <= start and end <= nxt:
                return view[start - begin : end - begin]
        for (begin, view), nxt in zip(views, ends):
            a, b = max(start, begin), min(end, nxt)
            if view is not None and a < b:
                self.host_flat[a:b].copy_(view[a - begin : b - begin])
        return self.host_flat[start:end]

    def _point_params(self, views: Sequence[tuple[int, torch.Tensor | None]]) -> None:
        """Parameters become views of the lent versions (or of host_flat) without copying."""
        lent = False
        for seg in self._segments:
            src = self._read(seg.start, seg.start + seg.numel, views)
            lent = lent or src.data_ptr() != self.host_flat[seg.start :].data_ptr()
            seg.param.data = src.view_as(seg.param)
        self._lent = lent

    def own_weights(self) -> None:
        """Parameters that are views of a lent, read-only version become views of host_flat with
        the same values: the model is then the caller's to read and write (before the lease on
        that version is given back, which lets the server write it again)."""
        if not self._lent:
            return
        with torch.no_grad():
            for seg in self._segments:
                self.host_flat[seg.start : seg.start + seg.numel].copy_(seg.param.reshape(-1))
        self._point_params(())
        self._storage = [seg.param.data_ptr() for seg in self._segments]  # (psgrad's move, not the user's)

    def host_weights(self) -> torch.Tensor:
        """The model's current weights (and buffers) as a float32 CPU tensor of the flat space (a
        copy unless unstaged)."""
        copy = self.staged or self._lent
        out = self.host_flat if not copy else torch.empty(self.total, dtype=torch.float32)
        if copy:
            with torch.no_grad():
                for seg in self._segments:
                    out[seg.start : seg.start + seg.numel].copy_(seg.param.reshape(-1))
        if self.buffers is not None:
            self.buffers.values(out[self.numel :])
        return out
