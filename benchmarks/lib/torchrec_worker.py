"""One TorchRec worker of benchmarks/dlrm.py: a rank of a gloo process group on CPU training the
benchmark's DLRM with TorchRec's DistributedModelParallel, run by TorchRec's own interpreter (it
needs no psgrad; make that interpreter as benchmarks/dlrm.py's docstring says):

    /work/torchrec-venv/bin/python benchmarks/lib/torchrec_worker.py --rank R --world 2 --store FILE

The ranks meet through a torch.distributed FileStore (no port to choose). Then each answers the
driver's JSON commands, one per stdin line, one reply per stdout line, as lib.children.Child
speaks (a command with "barrier" answers {"ready": true} once set up and waits for a "go" line):

- {"op": "run", ...}: build the model (the embedding tables as an EmbeddingBagCollection of one
  EmbeddingBagConfig per feature, sharded table-wise by TorchRec's planner, their Adagrad fused
  into the backward by fbgemm; the dense part replicated under DistributedDataParallel, stepped
  by torch.optim.Adagrad), load this rank's batches, train `warmup` + `steps` steps, then score
  the test examples (each rank half, gathered) and, on rank 0, write the scores to `scores`.
  Replies with the timed window (time.monotonic, one clock for every process of the host), the
  losses and the sharding plan.
- {"op": "quit"} or the end of stdin: leave.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder: dlrm_model, without lib's psgrad imports
from dlrm_model import INIT_STD, Batch, dense_arch, load_batches, train, training_batches  # noqa: E402

CPU = torch.device("cpu")


class Net(nn.Module):
    """TorchRec's EmbeddingBagCollection (feature f's bags pooled by sum from table t{f}) and the
    shared dense part."""

    def __init__(self, ebc: nn.Module, arch: nn.Module, features: int, dim: int) -> None:
        super().__init__()
        self.ebc, self.arch, self.features, self.dim = ebc, arch, features, dim

    def forward(self, dense: torch.Tensor, kjt: Any) -> torch.Tensor:
        # By key: the sharded collection's output holds the features shard by shard (f0, f2, ...,
        # f1, f3, ... with two ranks), not in the order of the configs.
        by_key = self.ebc(kjt).to_dict()
        pooled = torch.stack([by_key[f"f{f}"] for f in range(self.features)], dim=1)
        return self.arch(dense, pooled)


def kjt_of(batch: Batch, keys: list[str]) -> Any:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    return KeyedJaggedTensor(keys=keys, values=torch.cat(batch.values), lengths=torch.cat(batch.lengths))


def build(cfg: dict[str, Any], world: int) -> tuple[nn.Module, Any, dict[str, list[Any]]]:
    """The sharded model, its optimizer (fused Adagrad for the tables, torch's for the rest) and
    the plan: {table: [sharding type, compute kernel, ranks]}."""
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.distributed.types import ShardingType
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    features, rows, dim, lr, eps = cfg["features"], cfg["rows"], cfg["dim"], cfg["lr"], cfg["eps"]
    bound = INIT_STD * math.sqrt(3.0)  # uniform(-b, b) has variance b^2 / 3 = INIT_STD^2
    tables = [EmbeddingBagConfig(name=f"t{f}", embedding_dim=dim, num_embeddings=rows, feature_names=[f"f{f}"],
                                 pooling=PoolingType.SUM, weight_init_min=-bound, weight_init_max=bound)
              for f in range(features)]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    model = Net(ebc, dense_arch(features, dim, cfg["seed"]), features, dim)
    apply_optimizer_in_backward(torch.optim.Adagrad, model.ebc.parameters(), {"lr": lr, "eps": eps})
    sharder = EmbeddingBagCollectionSharder()
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world, compute_device="cpu"),
        constraints={t.name: ParameterConstraints(sharding_types=[ShardingType.TABLE_WISE.value]) for t in tables})
    plan = planner.collective_plan(model, [sharder], dist.GroupMember.WORLD)
    dmp = DistributedModelParallel(model, device=CPU, plan=plan, sharders=[sharder])
    dense_opt = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                      lambda params: torch.optim.Adagrad(params, lr=lr, eps=eps))
    opt = CombinedOptimizer([dmp.fused_optimizer, dense_opt])
    where = {name: [p.sharding_type, p.compute_kernel, p.ranks]
             for module_plan in plan.plan.values() for name, p in module_plan.items()}
    return dmp, opt, where


def run(cmd: dict[str, Any], rank: int, world: int, ready: Any) -> dict[str, Any]:
    model, opt, where = build(cmd, world)
    keys = [f"f{f}" for f in range(cmd["features"])]
    inputs = [(b.dense, kjt_of(b, keys), b.labels) for b in training_batches(cmd)]
    test = load_batches(cmd["test"], cmd["eval_batch"])
    eb = cmd["eval_batch"]
    if any(b.size != eb for b in test) or len(test) % world:
        raise ValueError(f"the test set must be a multiple of {world} x {eb} examples (eval_batch x ranks)")
    mine = test[rank::world]
    ready()
    trained = train(model, opt, inputs, cmd["warmup"])
    model.eval()
    with torch.no_grad():
        scores = torch.cat([model(b.dense, kjt_of(b, keys)) for b in mine])
    gathered = [torch.empty_like(scores) for _ in range(world)]
    dist.all_gather(gathered, scores)
    if rank == 0:  # batch i of the test set was rank i % world's
        parts = [gathered[i % world][(i // world) * eb:(i // world + 1) * eb] for i in range(len(test))]
        np.save(cmd["scores"], torch.cat(parts).numpy())
    del model, opt
    gc.collect()
    del trained["stepped"]
    return {**trained, "batch": cmd["batch"], "plan": where, "backend": dist.get_backend(), "torch": torch.__version__}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--store", required=True, help="the FileStore's file, the same for every rank")
    parser.add_argument("--bind-cores", action="store_true", help="bind this rank to its share of the host's cores, "
                        "as psgrad.bind_cores does a psgrad worker (rank r of --world: the r-th of equal runs)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.bind_cores:  # (before gloo's threads start: they inherit it)
        sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo: psgrad's rule itself (no grpc needed)
        from psgrad.core.cores import bind_cores

        bind_cores(args.rank, args.world)
    store = dist.FileStore(args.store, args.world)
    dist.init_process_group("gloo", store=store, rank=args.rank, world_size=args.world)

    def reply(obj: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    try:
        for line in sys.stdin:
            if not line.strip():
                continue
            cmd = json.loads(line)
            if cmd.get("op") == "quit":
                break
            barrier = cmd.pop("barrier", False)

            def ready() -> None:
                if barrier:
                    reply({"ready": True})
                    sys.stdin.readline()  # "go"

            try:
                if cmd.get("op") != "run":
                    raise ValueError(f"unknown op {cmd.get('op')!r}")
                reply(run(cmd, args.rank, args.world, ready))
            except Exception as exc:
                reply({"error": f"{type(exc).__name__}: {exc}"})
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip the interpreter's teardown (seconds with torch and fbgemm loaded, for nothing)


if __name__ == "__main__":
    main()
