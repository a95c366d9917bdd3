"""Micro experiment (2026-11-27, seventh session; kept in git history only): do a decode step's two halves overlap, one half's decode attention
on a side stream beside the other half's projection GEMMs? bench-8b's layer shapes, 32 layers
(8 distinct weight sets and KV caches, cycled: each far larger than L2), captured in one CUDA
graph per variant, replay timed with events.

Variants, per (batch B, context C):
  whole     : each layer qkv(B) -> attn(B) -> o, gate_up, silu, down (B), one stream
  halves    : the same in two halves of B/2, one after the other (the split's GEMM cost)
  overlap   : halves, attention on a side stream (A's attention beside B's GEMMs and back)
  overlap-hi: as overlap, the side stream at high priority
And attention alone (B), GEMMs alone (B)."""

import sys
import torch
import torch.nn.functional as F

from lightllm_kernels import decode_attention, silu_and_mul

H, HQ, HK, D, I = 4096, 32, 8, 128, 14336
SETS = 8
LAYERS = 32
dev = torch.device("cuda")
torch.manual_seed(0)
dt = torch.bfloat16


def weights():
    def w(o, i):
        return (torch.randn(o, i, device=dev, dtype=dt) * 0.02)
    return dict(qkv=w(HQ * D + 2 * HK * D, H), o_t=w(H, HQ * D).t().contiguous(), gu=w(2 * I, H),
                down_t=w(H, I).t().contiguous())


W = [weights() for _ in range(SETS)]


def setup(B, C):
    tokens = B * C + 1
    caches = [(torch.randn(tokens, HK, D, device=dev, dtype=dt), torch.randn(tokens, HK, D, device=dev, dtype=dt))
              for _ in range(SETS)]
    perm = torch.randperm(tokens - 1, device=dev).int() + 1
    req_to_token = perm.view(B, C)
    rows = torch.arange(B, device=dev, dtype=torch.int32)
    lens = torch.full((B,), C, device=dev, dtype=torch.int32)
    return caches, req_to_token, rows, lens


def pre(w, x):
    return F.linear(x, w["qkv"])


def attn(qkv, cache, r2t, rows, lens, C, out):
    q = qkv[:, : HQ * D].view(-1, HQ, D)
    decode_attention(q, cache[0], cache[1], r2t, rows, lens, C, D ** -0.5, out=out.view(-1, HQ, D))


def post(w, a):
    x = a @ w["o_t"]
    g = silu_and_mul(F.linear(x, w["gu"]))
    return g @ w["down_t"]


def run_whole(x, caches, r2t, rows, lens, C, parts=1, side=None):
    B = x.shape[0]
    n = B // parts
    outs = [torch.empty(n, HQ * D, device=dev, dtype=dt) for _ in range(parts)]
    xs = [x[i * n:(i + 1) * n] for i in range(parts)]
    if side is None:
        for L in range(LAYERS):
            w, cache = W[L % SETS], caches[L % SETS]
            for p in range(parts):
                qkv = pre(w, xs[p])
                attn(qkv, cache, r2t, rows[p * n:(p + 1) * n], lens[p * n:(p + 1) * n], C, outs[p])
                xs[p] = post(w, outs[p])
        return xs
    # overlapped halves: main: pre_A(L); side: attn_A(L); main: post_B(L-1), pre_B(L); side: attn_B(L);
    # main: wait attn_A(L), post_A(L) ...
    main = torch.cuda.current_stream()
    done = [None, None]
    for L in range(LAYERS):
        w, cache = W[L % SETS], caches[L % SETS]
        for p in range(2):
            if L > 0 and p == 1:
                main.wait_event(done[1])
                xs[1] = post(W[(L - 1) % SETS], outs[1])
            qkv = pre(w, xs[p])
            ev = torch.cuda.Event()
            ev.record(main)
            side.wait_event(ev)
            with torch.cuda.stream(side):
                attn(qkv, cache, r2t, rows[p * n:(p + 1) * n], lens[p * n:(p + 1) * n], C, outs[p])
                done[p] = torch.cuda.Event()
                done[p].record(side)
            if p == 1:
                main.wait_event(done[0])
                xs[0] = post(w, outs[0])
    main.wait_event(done[1])
    xs[1] = post(W[(LAYERS - 1) % SETS], outs[1])
    return xs


def attn_only(x, caches, r2t, rows, lens, C):
    out = torch.empty(x.shape[0], HQ * D, device=dev, dtype=dt)
    qkv = torch.randn(x.shape[0], HQ * D + 2 * HK * D, device=dev, dtype=dt)
    for L in range(LAYERS):
        attn(qkv, caches[L % SETS], r2t, rows, lens, C, out)


def gemms_only(x):
    for L in range(LAYERS):
        w = W[L % SETS]
        qkv = pre(w, x)
        x = post(w, qkv[:, : HQ * D].contiguous())


def timed(fn, reps=10):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(reps):
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    ts.sort()
    del g
    return ts[len(ts) // 2]


def main():
    cases = [(int(b), int(c)) for b, c in (s.split("x") for s in sys.argv[1].split(","))]
    print(torch.cuda.get_device_name(), torch.__version__)
    print("| B x C | attn alone ms | GEMMs alone ms | whole ms | halves ms | overlap ms | overlap-hi ms | best / whole |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for B, C in cases:
        caches, r2t, rows, lens = setup(B, C)
        x = torch.randn(B, H, device=dev, dtype=dt) * 0.1
        with torch.inference_mode():
            # correctness: overlapped halves give the same output as sequential halves
            ref = torch.cat(run_whole(x, caches, r2t, rows, lens, C, parts=2))
            side = torch.cuda.Stream()
            got = torch.cat(run_whole(x, caches, r2t, rows, lens, C, parts=2, side=side))
            torch.cuda.synchronize()
            same = torch.equal(ref, got)
            t_attn = timed(lambda: attn_only(x, caches, r2t, rows, lens, C))
            t_gemm = timed(lambda: gemms_only(x))
            t_whole = timed(lambda: run_whole(x, caches, r2t, rows, lens, C))
            t_halves = timed(lambda: run_whole(x, caches, r2t, rows, lens, C, parts=2))
            t_ov = timed(lambda: run_whole(x, caches, r2t, rows, lens, C, parts=2, side=torch.cuda.Stream()))
            hi = torch.cuda.Stream(priority=-1)
            t_hi = timed(lambda: run_whole(x, caches, r2t, rows, lens, C, parts=2, side=hi))
        best = min(t_ov, t_hi)
        print(f"| {B} x {C} | {t_attn:.2f} | {t_gemm:.2f} | {t_whole:.2f} | {t_halves:.2f} | {t_ov:.2f} | {t_hi:.2f} | "
              f"{best / t_whole:.3f}{'' if same else ' MISMATCH'} |", flush=True)
        del caches
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
