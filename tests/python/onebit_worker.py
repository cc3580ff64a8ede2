"""One rank of a 2-process 1-bit Adam run through loom.torch.Optimizer (run by
test_distributed.py, directly with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT or under
torchrun). With WORKER_MODE=torch_distributed the rank first starts torch.distributed
(gloo, env://, on MASTER_PORT) and the optimizer opens its own session by plugin name over
loom.torch.distributed_bootstrap(). Each rank has its own gradients; writes its parameters, the distance of its
warmup from torch.optim.Adam over the averaged gradients, and the traffic counters, to
OUT_DIR/rankN.json. With WORKER_SHARD=1 the optimizer keeps sharded state (shard_state = true:
each rank the moments of half the parameters). With WORKER_OVERLAP=1 the gradients come from a
backward whose hooks announce them (overlap_backward, buckets of 0.001 MiB), against the same
buckets stepped without hooks; WORKER_OVERLAP_PLUGIN names the 1-bit optimizer then (each of
its phases within the 30 steps; the Adam reference applies to onebit_adam's warmup only)."""
import io
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir,
                                os.pardir, "bindings", "python"))

import torch  # noqa: E402

import loom  # noqa: E402
import loom.torch  # noqa: E402

FREEZE = 10
STEPS = 30
RESUME = 17  # after the freeze: the error feedback is part of the state
SHAPES = [(7,), (33, 5), (1001,)]
MANIFEST = f"""
[comm.world]
plugin = "ucx"

[codec.onebit]
plugin = "onebit"

[optimizer.main]
plugin = "onebit_adam"
comm = "world"
codec = "onebit"
freeze_step = {FREEZE}
"""
# Each plugin's lines for the overlap run: its phases within STEPS.
PHASES = {
    "onebit_adam": f'plugin = "onebit_adam"\nfreeze_step = {FREEZE}\n',  # MANIFEST's
    "zero_one_adam": f'plugin = "zero_one_adam"\nvar_freeze_step = {FREEZE}\n'
                     'var_update_scaler = 2\nlocal_step_scaler = 4\nlocal_step_clipper = 4\n',
    "onebit_lamb": f'plugin = "onebit_lamb"\nfreeze_step = {FREEZE}\n',
}


def main():
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    g0 = torch.Generator().manual_seed(0)
    p0 = [torch.randn(s, generator=g0) for s in SHAPES]
    params = [p.clone().requires_grad_() for p in p0]
    ref = [p.clone().requires_grad_() for p in p0]
    out = {"rank": rank, "world": world}
    mode = os.environ.get("WORKER_MODE", "host")
    overlap = bool(os.environ.get("WORKER_OVERLAP"))
    out["plugin"] = os.environ.get("WORKER_OVERLAP_PLUGIN", "onebit_adam") if overlap \
        else "onebit_adam"
    if mode == "torch_distributed_host_bootstrap":
        # The contrast: torch.distributed holds MASTER_PORT, and the host's own rendezvous
        # (bootstrap=None) cannot have it.
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method="env://")
        # Both ranks through init before either can fail and exit (rank 0's exit takes the
        # store away, and a rank still in init would die of a connection reset).
        dist.barrier()
        try:
            loom.torch.Optimizer(params, plugin="onebit_adam", lr=1e-2, bootstrap=None,
                                 log_level="off")
        except loom.LoomError as e:
            print(f"{type(e).__name__}: {e}", flush=True)
            os._exit(3)
        os._exit(0)
    if mode == "torch_distributed":
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method="env://")
        # The default bootstrap="auto" takes torch.distributed's group: the host's own
        # rendezvous would find MASTER_PORT held by torch's store on rank 0.
        opt = loom.torch.Optimizer(params, plugin="onebit_adam", freeze_step=FREEZE, lr=1e-2,
                                   log_level="error")
        out["session"] = opt._session.describe()
        out["bootstrap"] = repr(opt._session._bootstrap)
        s = opt._session
        # A second optimizer over a copy, interrupted at RESUME and restored from its
        # torch.save'd state dict into a new session: it must follow the first bit for bit.
        params2 = [p.clone().detach().requires_grad_() for p in p0]
        opt2 = loom.torch.Optimizer(params2, plugin="onebit_adam", freeze_step=FREEZE, lr=1e-2,
                                    log_level="error")
    elif overlap:
        # The same buckets twice: announced by the gradient hooks during the backward, and
        # stepped without hooks; the parameters must stay the same bits.
        bucketed = (MANIFEST[:MANIFEST.index("[optimizer.main]")] +
                    '[optimizer.main]\ncomm = "world"\ncodec = "onebit"\n' + PHASES[out["plugin"]] +
                    "bucket_mb = 0.001\n")
        manifest = bucketed + "[optimizer.plain]" + bucketed.split("[optimizer.main]")[1]
        s = loom.Session.from_string(manifest, "onebit.toml", log_level="error")
        opt = loom.torch.Optimizer(params, s.optimizer("main"), lr=1e-2, overlap_backward=True)
        params2 = [p.clone().detach().requires_grad_() for p in p0]
        opt2 = loom.torch.Optimizer(params2, s.optimizer("plain"), lr=1e-2)
    else:
        manifest = MANIFEST + ("shard_state = true\n" if os.environ.get("WORKER_SHARD") else "")
        s = loom.Session.from_string(manifest, "onebit.toml", log_level="error")
        opt = loom.torch.Optimizer(params, s.optimizer(), lr=1e-2)
        opt2 = None
    with s:
        adam = torch.optim.Adam(ref, lr=1e-2)
        for step in range(1, STEPS + 1):
            gens = [torch.Generator().manual_seed(1000 * step + r) for r in range(world)]
            grads = [[torch.randn(sh, generator=g) for sh in SHAPES] for g in gens]
            if overlap:
                # Through a backward, so the hooks run: d/dp sum(p * g) is g, exactly.
                for p in params:
                    p.grad = None
                sum((p * g).sum() for p, g in zip(params, grads[rank])).backward()
            else:
                for p, g in zip(params, grads[rank]):
                    p.grad = g.clone()  # local gradients: the optimizer averages them itself
            opt.step()
            if opt2 is not None:
                for p, g in zip(params2, grads[rank]):
                    p.grad = g.clone()
                opt2.step()
                if overlap:
                    out.setdefault("overlap_identical", True)
                    out["overlap_identical"] &= all(torch.equal(a, b)
                                                    for a, b in zip(params, params2))
                if step == RESUME and not overlap:
                    buf = io.BytesIO()
                    torch.save(opt2.state_dict(), buf)
                    opt2.close()
                    opt2 = loom.torch.Optimizer(params2, plugin="onebit_adam",
                                                freeze_step=FREEZE, lr=1e-2, log_level="error")
                    buf.seek(0)
                    opt2.load_state_dict(torch.load(buf))
            if step <= FREEZE:
                for p, *gs in zip(ref, *grads):
                    p.grad = sum(gs) / world
                adam.step()
            if step == FREEZE:
                out["warmup_rel"] = max(((a - b).norm() / b.norm()).item()
                                        for a, b in zip(params, ref))
        out_params = [p.detach().view(-1).tolist() for p in params]
        if overlap:
            # A second backward before step(): refused by the plugin, which drops the step in
            # progress (state as before); then a backward and a step go through again.
            gs = [torch.randn(sh, generator=torch.Generator().manual_seed(rank)) for sh in SHAPES]
            for p in params:
                p.grad = None
            sum((p * g).sum() for p, g in zip(params, gs)).backward()
            try:
                sum((p * g).sum() for p, g in zip(params, gs)).backward()
                out["second_backward"] = "accepted"
            except loom.FailedPreconditionError as e:
                out["second_backward"] = str(e)
            before = opt.instance.export_state()
            for p in params:
                p.grad = None
            sum((p * g).sum() for p, g in zip(params, gs)).backward()
            opt.step()
            out["stepped_after_refusal"] = opt.instance.export_state() != before
        out["params"] = out_params  # as the loop left them
        out["info"] = opt.comm_info()
        out["state_bytes"] = len(opt.instance.export_state())
        if opt2 is not None and not overlap:
            out["resumed_identical"] = all(torch.equal(a, b) for a, b in zip(params, params2))
            out["resumed_info"] = opt2.comm_info()
            opt2.close()
    with open(os.path.join(os.environ["OUT_DIR"], f"rank{rank}.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
