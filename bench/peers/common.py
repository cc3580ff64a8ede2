"""Shared by the peer scripts: what the DeepSpeed 1-bit path does, in torch."""
import math


def size_label(n):
    """1 << 28 -> "256M", 1 << 26 -> "64M", 65536 -> "64K"."""
    for unit, div in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div}{unit}"
    return str(n)


def plus_minus_one(t):
    """+1 where t >= 0, -1 elsewhere (0 counts as positive, as in DeepSpeed)."""
    return t.sign().add_(1).bool().float().add_(-0.5).mul_(2.0)


def onebit_round_trip(torch, x, worker_error, server_error, pack, unpack):
    """DeepSpeed's compressed allreduce (1-bit Adam) on a world of one, as its torch backend
    does it: the worker adds its error, takes the RMS scale, updates the error and packs the
    signs; the server unpacks, scales, adds its error and does the same; the result is the
    server's chunk unpacked and scaled. `pack` turns a bool tensor into packed bytes (numpy
    or cupy packbits), `unpack` back into a float tensor of 0/1 on x's device."""
    buf = x.clone()
    buf.add_(worker_error)
    scale = torch.linalg.norm(buf) / math.sqrt(buf.numel())
    worker_error.set_(buf - scale * plus_minus_one(buf))
    sent = pack(buf.sign_().add_(1).bool())
    # Server side (the only chunk, world size 1).
    server = unpack(sent).add_(-0.5).mul_(2.0).mul_(scale)
    server.add_(server_error)
    server_scale = torch.linalg.norm(server) / math.sqrt(server.numel())
    server_error.set_(server - server_scale * plus_minus_one(server))
    gathered = pack(server.sign_().add_(1).bool())
    return unpack(gathered).add_(-0.5).mul_(2.0).mul_(server_scale)
