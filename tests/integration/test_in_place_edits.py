"""Writing the model's parameters in place after ps.optimizer(model) — load_state_dict, nn.init, an
in-place op — neither crashes (on the same-host path the parameters view weights a server lent,
which once segfaulted the worker) nor is silently overwritten: the next step() refuses, naming the
parameter, and refresh() takes the job's weights back."""
from __future__ import annotations


import pytest
import torch
from torch import nn

import psgrad
from conftest import run_python
from psgrad.client import parameter_client
from psgrad.config import ClientConfig
from psgrad.errors import ConfigError

pytestmark = pytest.mark.timeout(120)

# In a child process: a segfault must fail the test, not end the test run. One child tries every
# edit in turn (a fresh server, model and optimizer for each): its output is one block per edit.
SCRIPT = """
import sys, torch
from torch import nn
import psgrad
from psgrad.config import ClientConfig, ServerConfig
from psgrad.errors import ConfigError
from psgrad.client import parameter_client
from psgrad.server.runtime import start_server

parameter_client.LEND_MIN_BYTES = 0  # (a small model's versions lent all the same: the path this guards)
shared_memory, device, edits = sys.argv[1] == "1", sys.argv[2], sys.argv[3:]
for edit in edits:
    print("edit", edit, flush=True)
    server = start_server(ServerConfig(port=0, threads=4, lease_s=10.0))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2)).to(device)
    x = torch.randn(16, 8, device=device)
    with psgrad.connect([server.address], client=ClientConfig(shared_memory=shared_memory)) as ps:
        opt = ps.optimizer(model)
        def step():
            opt.zero_grad(); model(x).sum().backward(); return opt.step()
        step()
        print("path", "lent" if opt.flat._lent else "copied", flush=True)
        with torch.no_grad():
            if edit == "load_state_dict":
                model.load_state_dict({k: torch.zeros_like(v) for k, v in model.state_dict().items()})
            else:
                nn.init.zeros_(model[2].weight)
        print("edited", flush=True)
        try:
            step()
        except ConfigError as exc:
            print("refused:", exc, flush=True)
        else:
            print("applied silently", flush=True)
        opt.refresh()
        assert float(model[2].weight.abs().sum()) > 0, "refresh brought the job's weights back"
        step()
        print("continued", flush=True)
    server.stop(0)
"""
EDITS = ["load_state_dict", "nn.init"]


@pytest.mark.parametrize("shared_memory, device", [(True, "cpu"), (False, "cpu"), pytest.param(True, "cuda", marks=pytest.mark.cuda)],
                         ids=["same-host", "grpc", "cuda"])
def test_an_in_place_edit_is_refused_by_name_not_a_crash(shared_memory: bool, device: str) -> None:
    """Each edit: load_state_dict, nn.init. (On CUDA the parameters are the worker's own device memory:
    the pulled weights are copied in.)"""
    res = run_python(["-c", SCRIPT, "1" if shared_memory else "0", device, *EDITS], timeout_s=100)  # (from the template)
    assert res.returncode == 0, (res.returncode, res.stdout, res.stderr[-2000:])
    out = res.stdout.splitlines()
    assert len(out) == 5 * len(EDITS), out
    for k, edit in enumerate(EDITS):
        edit_line, *lines = out[5 * k: 5 * k + 5]
        assert edit_line == f"edit {edit}", out
        assert lines[0] == ("path lent" if shared_memory and device == "cpu" else "path copied"), lines
        assert lines[1] == "edited"
        assert lines[2].startswith("refused: parameter '") and "changed in place after ps.optimizer(model)" in lines[2], lines
        assert "'2.weight'" in lines[2] or edit == "load_state_dict", lines[2]
        assert lines[3] == "continued", lines


CONVERSIONS = {
    "double": lambda m: m.double(),
    "half": lambda m: m.half(),
    "new-data": lambda m: setattr(m[2].weight, "data", m[2].weight.detach().clone()),
    "new-parameter": lambda m: setattr(m[2], "weight", nn.Parameter(m[2].weight.detach().clone())),
    "new-module": lambda m: m.__setitem__(2, nn.Linear(4, 2)),
}


@pytest.mark.parametrize("conversion", list(CONVERSIONS))
@pytest.mark.parametrize("shared_memory", [True, False], ids=["same-host", "grpc"])
def test_a_model_converted_after_ps_optimizer_is_refused_by_name(make_servers, monkeypatch: pytest.MonkeyPatch,  # type: ignore[no-untyped-def]
                                                                  shared_memory: bool, conversion: str) -> None:
    """model.double() (or .half(), a new tensor or parameter) after ps.optimizer(model) leaves the
    optimizer's buffers, which the job pushes and pulls, out of the model: step() and refresh() refuse
    it, naming the parameter, instead of training nothing."""
    monkeypatch.setattr(parameter_client, "LEND_MIN_BYTES", 0)  # (same host: the parameters view lent versions)
    (server,) = make_servers(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2))
    x = torch.randn(16, 8)
    with psgrad.connect([server.address], client=ClientConfig(shared_memory=shared_memory)) as ps:
        opt = ps.optimizer(model)
        opt.zero_grad(); model(x).sum().backward(); opt.step()
        model[1] = nn.GELU()  # (a module without parameters swapped: nothing left the buffers)
        opt.zero_grad(); model(x).sum().backward(); opt.step()
        CONVERSIONS[conversion](model)
        dtype = next(model.parameters()).dtype
        opt.zero_grad(); model(x.to(dtype)).sum().backward()
        name = "'0.weight'" if conversion in ("double", "half") else "'2.weight'"
        for call in (opt.step, opt.refresh):
            with pytest.raises(ConfigError, match=f"parameter {name} .* after ps.optimizer\\(model\\).* convert the "
                                                  "model before ps.optimizer\\(model\\)"):
                call()


@pytest.mark.parametrize("shared_memory", [True, False], ids=["same-host", "grpc"])
def test_refresh_after_leave_is_not_taken_for_a_conversion(make_servers, monkeypatch: pytest.MonkeyPatch,  # type: ignore[no-untyped-def]
                                                           shared_memory: bool) -> None:
    """leave() gives the parameters memory of their own (off the lent versions): psgrad's move, so a
    refresh() for evaluation after it still works."""
    monkeypatch.setattr(parameter_client, "LEND_MIN_BYTES", 0)
    (server,) = make_servers(1)
    model = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2))
    with psgrad.connect([server.address], client=ClientConfig(shared_memory=shared_memory)) as ps:
        opt = ps.optimizer(model)
        opt.zero_grad(); model(torch.randn(16, 8)).sum().backward(); opt.step()
        assert opt.flat._lent == shared_memory
        ps.leave()
        opt.refresh()
