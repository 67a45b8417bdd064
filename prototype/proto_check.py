import os, re, subprocess, sys, time, torch
from torch import nn
import psgrad
import psgrad.client.parameter_client as pc
S = 2; T = 8; N = 3440; DIM = 32
procs, addrs = [], []
for i in range(S):
    log = f"/tmp/s/psrv{i}.log"
    p = subprocess.Popen([sys.executable, "-m", "psgrad", "server", "--host", "127.0.0.1", "--port", "0", "--lease-s", "600",
                          "--insecure"], stdout=open(log, "w"), stderr=subprocess.STDOUT)
    while True:
        m = re.search(r"psgrad server listening on (\S+)", open(log).read())
        if m: addrs.append(m.group(1)); break
        time.sleep(0.05)
    procs.append(p)
try:
    model = nn.Module(); model.embs = nn.ModuleList(psgrad.Embedding(1_000_000 // T, DIM, std=0.0) for _ in range(T)); model.head = nn.Linear(DIM, 8)
    session = psgrad.connect(addrs, rank=0, num_workers=1, mode="async", optimizer=psgrad.Adagrad(lr=0.1, eps=1e-10))
    opt = session.optimizer(model); c = opt.client
    g = torch.Generator().manual_seed(0)
    rows = {t: (torch.randperm(1_000_000 // T, generator=g)[:N // T].sort().values, torch.randn(N // T, DIM, generator=g)) for t in c.tables}
    dense, weights = torch.zeros(c.plan.total), torch.zeros(c.plan.total); clock = opt.clock
    c.pull_tables({t: i for t, (i, _) in rows.items()})  # description written
    for _ in range(5):
        c.exchange(dense, clock, weights, rows=rows); clock += 1
    # half the ids touched, half never stored
    ask = {t: torch.cat([i[: len(i) // 2], torch.randperm(1_000_000 // T, generator=g)[:50]]).unique() for t, (i, _) in rows.items()}
    local = c.pull_tables(ask, checked=True)
    pc._PROTO_SHARE = False
    remote = c.pull_tables(ask, checked=True)
    pc._PROTO_SHARE = True
    used = bool(pc._PROTO_MAPS)
    ok = all(torch.equal(local[t], remote[t]) for t in ask)
    nz = sum(int((remote[t] != 0).any(dim=1).sum()) for t in ask)
    import time as _t
    ask2 = {t: i for t, (i, _) in rows.items()}
    for mode in (True, False, True, False):
        pc._PROTO_SHARE = mode
        for _ in range(50): c.pull_tables(ask2, checked=True)
        t0 = _t.thread_time()
        for _ in range(1000): c.pull_tables(ask2, checked=True)
        print("local" if mode else "rpc  ", f"{(_t.thread_time() - t0):.3f} ms thread cpu per read")
    pc._PROTO_SHARE = True
    import cProfile, pstats
    pr = cProfile.Profile(); pr.enable()
    for _ in range(1000): c.pull_tables(ask2, checked=True)
    pr.disable(); pstats.Stats(pr).sort_stats("tottime").print_stats(12)
    print("local maps used:", used, "equal:", ok, "nonzero rows:", nz, "of", sum(len(v) for v in ask.values()))
finally:
    for p in procs: p.terminate()
    for p in procs: p.wait()
