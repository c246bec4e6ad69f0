"""GB/s of the kvbridge torch ops (kvbridge.ops) per SGLang host layout and one vLLM layout,
against torch doing the same gather/scatter and a plain copy of the same bytes, in one run.

CPU: the op packs pages from an SGLang device pool (per-layer K/V tensors, here in host
memory) into each host layout (and unpacks page_first), and packs vLLM FlashInfer blocks
(num_blocks, 2, block_size, H, D) into a page buffer. Baselines: the same pages moved with
torch.index_select + index_copy_ (one pair per layer and K/V part, page-granular indices),
and dst.copy_(src) of the same number of contiguous bytes, all with the same threads.
CUDA (when usable): the same between device tensors against a device-to-device copy of the
same bytes (headline: page_first pack with >= 64 KiB per layer and K/V, goal 0.85), and
page_first into pinned host memory against a device-to-host copy.

Progress goes to stderr; the last stdout line is one JSON object (docs/benchmarks.md). The
C++ kvb_bench_kernels measures the C API against memcpy instead: benchmarks/run kernels-c.
Run this one with benchmarks/run kernels, or
PYTHONPATH=<build>/python .venv/bin/python benchmarks/bench_kernels.py [--quick]
[--device cpu|cuda|auto] [--seconds S] [--threads N] [--pages N] [--no-gpu].
"""

import sys
import time

import torch
from benchlib import emit, gbps, median, parser, positive_int, ratio, rnd

from kvbridge import ops

LAYERS = 8
HEADS, HEAD_DIM = 8, 128
DTYPE = torch.bfloat16
ROW_BYTES = HEADS * HEAD_DIM * 2  # one token of one layer and K/V part
SGLANG_CASES = [("page_first", True), ("page_first", False), ("page_first_direct", True),
                ("layer_first", True)]
VLLM_LAYOUT = "flashinfer (num_blocks, 2, block_size, H, D)"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def parse_args(argv):
    p = parser(__doc__, quick="fewer sizes and shorter trials",
               seconds="seconds per measured trial of one operation (default 1, quick 0.2)")
    p.add_argument("--device", choices=["cpu", "cuda", "auto"], default="auto",
                   help="cpu: CPU only; cuda: GPU only (fails without one); auto: CPU, and the "
                        "GPU when one is usable (default)")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="CPU threads for every contender (default: torch.get_num_threads())")
    p.add_argument("--pages", type=int, default=0, help="pages per copy (default: by mode)")
    p.add_argument("--no-gpu", action="store_true", help="same as --device cpu")
    a = p.parse_args(argv)
    if a.no_gpu:
        a.device = "cpu"
    if a.seconds is None:
        a.seconds = 0.2 if a.quick else 1.0
    if a.threads is None:
        a.threads = torch.get_num_threads()
    a.threads = max(1, a.threads)
    return a


# ---- Pools ------------------------------------------------------------------------------


class SglangPools:
    """An SGLang device pool (K and V layers, views of one buffer) and a host pool, both
    `pages` pages; all pages move, device pages shuffled (as HiCache backs up pages the radix
    tree scattered into fresh host pages)."""

    def __init__(self, pages: int, page_size: int, device: torch.device, host_device,
                 pin: bool = False):
        self.pages, self.page_size = pages, page_size
        slots = pages * page_size
        self.device_pool = torch.ones(2 * LAYERS, slots, HEADS, HEAD_DIM, dtype=DTYPE,
                                      device=device)
        self.k = [self.device_pool[i] for i in range(LAYERS)]
        self.v = [self.device_pool[LAYERS + i] for i in range(LAYERS)]
        self.host_flat = torch.zeros(self.device_pool.numel(), dtype=DTYPE, device=host_device,
                                     pin_memory=pin)
        gen = torch.Generator().manual_seed(42)
        dev_pages = torch.randperm(pages, generator=gen)
        host_pages = torch.arange(pages)
        self.dev_pages, self.host_pages = dev_pages.to(device), host_pages.to(device)
        offsets = torch.arange(page_size)
        self.dev_slots = (dev_pages[:, None] * page_size + offsets).reshape(-1).to(device)
        self.host_slots = (host_pages[:, None] * page_size + offsets).reshape(-1).to(device)
        self.bytes = self.device_pool.numel() * self.device_pool.element_size()

    def host(self, layout: str) -> torch.Tensor:
        shape = ops.sglang_host_shape(layout, n_layers=LAYERS, total_slots=self.pages *
                                      self.page_size, row_shape=(HEADS, HEAD_DIM),
                                      page_size=self.page_size)
        return self.host_flat.view(shape)

    def host_page_views(self, layout: str):
        """Per (kv, layer): the host pool as (pages, P, H, D), page-indexable along dim 0."""
        h, P, n = self.host(layout), self.page_size, self.pages
        views = []
        for kv in range(2):
            for layer in range(LAYERS):
                if layout == "layer_first":
                    views.append(h[kv, layer].view(n, P, HEADS, HEAD_DIM))
                elif layout == "page_first":
                    views.append(h[kv].view(n, P, LAYERS, HEADS, HEAD_DIM)[:, :, layer])
                else:
                    views.append(h[kv][:, layer])
        return views

    def op(self, layout: str, pack: bool, threads: int):
        fn = ops.sglang_device_to_host if pack else ops.sglang_host_to_device
        host = self.host(layout)
        return lambda: fn(self.k, self.v, host, self.dev_slots, self.host_slots, layout=layout,
                          page_size=self.page_size, num_threads=threads)

    def torch_index(self, layout: str, pack: bool):
        P, n = self.page_size, self.pages
        dev_views = [t.view(n, P, HEADS, HEAD_DIM) for t in self.k + self.v]
        host_views = self.host_page_views(layout)

        if self.host_flat.device != self.device_pool.device:
            # Pinned host pool: gather on the GPU, then scatter on the CPU.
            host_pages = self.host_pages.cpu()

            def staged():
                for d, h in zip(dev_views, host_views):
                    h.index_copy_(0, host_pages, d.index_select(0, self.dev_pages).cpu())
            return staged

        def run():
            for d, h in zip(dev_views, host_views):
                if pack:
                    h.index_copy_(0, self.host_pages, d.index_select(0, self.dev_pages))
                else:
                    d.index_copy_(0, self.dev_pages, h.index_select(0, self.host_pages))
        return run

    def plain_copy(self, pack: bool):
        dev_flat = self.device_pool.view(-1)
        if pack:
            return lambda: self.host_flat.copy_(dev_flat)
        return lambda: dev_flat.copy_(self.host_flat)


class VllmPools:
    """vLLM FlashInfer per-layer blocks (num_blocks, 2, block_size, H, D) and a page buffer."""

    def __init__(self, blocks: int, block_size: int, device: torch.device):
        self.blocks, self.block_size = blocks, block_size
        self.layers = [torch.ones(blocks, 2, block_size, HEADS, HEAD_DIM, dtype=DTYPE,
                                  device=device) for _ in range(LAYERS)]
        self.page_shape = ops.vllm_page_shape(self.layers, kv_dim=1, block_dim=0)
        self.pages_buf = torch.zeros(blocks, *self.page_shape, dtype=DTYPE, device=device)
        gen = torch.Generator().manual_seed(43)
        self.block_ids = torch.randperm(blocks, generator=gen).to(device)
        self.page_ids = torch.arange(blocks).to(device)
        self.bytes = sum(t.numel() for t in self.layers) * 2

    def op(self, threads: int):
        return lambda: ops.vllm_blocks_to_pages(self.layers, self.pages_buf, self.block_ids,
                                                self.page_ids, kv_dim=1, block_dim=0,
                                                num_threads=threads)

    def torch_index(self):
        pages = self.pages_buf.view(self.blocks, LAYERS, 2, self.block_size, HEADS, HEAD_DIM)

        def run():
            for layer, t in enumerate(self.layers):
                pages[:, layer].index_copy_(0, self.page_ids, t.index_select(0, self.block_ids))
        return run

    def plain_copy(self):
        src = torch.ones(self.pages_buf.numel(), dtype=DTYPE, device=self.pages_buf.device)
        dst = self.pages_buf.view(-1)
        return lambda: dst.copy_(src)


# ---- Timing -----------------------------------------------------------------------------


def cpu_rate(fn, nbytes: int, seconds: float) -> float:
    fn()  # warm
    runs, start = 0, time.perf_counter()
    while True:
        fn()
        runs += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return gbps(nbytes * runs, elapsed)


def gpu_rate(fn, nbytes: int, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return gbps(nbytes * reps, start.elapsed_time(end) / 1e3)


def measure_cpu(contenders: dict, nbytes: int, seconds: float, trials: int) -> dict:
    """Median GB/s of each contender, trials interleaved so drift hits all alike."""
    rates = {name: [] for name in contenders}
    for _ in range(trials):
        for name, fn in contenders.items():
            rates[name].append(cpu_rate(fn, nbytes, seconds))
    return {name: median(r) for name, r in rates.items()}


def row(engine, layout, direction, page_size, nbytes, page_bytes, r, baseline_name,
        memory=None) -> dict:
    out = {"engine": engine, "layout": layout, "direction": direction}
    if memory:
        out["memory"] = memory
    out.update({
        "page_size": page_size, "chunk_bytes": page_size * ROW_BYTES, "page_bytes": page_bytes,
        "bytes": nbytes, "gbps": rnd(r["kvbridge"]),
        "baseline_name": baseline_name, "baseline_gbps": rnd(r["copy"]),
        "ratio": ratio(r["kvbridge"], r["copy"]),
        "torch_index_gbps": rnd(r["torch_index"]),
        "ratio_vs_torch_index": ratio(r["kvbridge"], r["torch_index"]),
    })
    return out


def describe(r: dict) -> str:
    return (f"{r['gbps']:7.2f} GB/s, copy {r['baseline_gbps']:7.2f} (ratio {r['ratio']:.2f}), "
            f"torch index_select+index_copy_ {r['torch_index_gbps']:7.2f} "
            f"(x{r['ratio_vs_torch_index']:.2f})")


def run_cpu(a) -> list:
    torch.set_num_threads(a.threads)
    trials = 3 if a.quick else 5
    results = []
    for page_size in ([32] if a.quick else [32, 64, 128]):
        pages = a.pages or max(8, (48 if a.quick else 192) * 32 // page_size)
        pools = SglangPools(pages, page_size, torch.device("cpu"), "cpu")
        page_bytes = LAYERS * 2 * page_size * ROW_BYTES
        for layout, pack in SGLANG_CASES:
            r = measure_cpu({"copy": pools.plain_copy(pack),
                             "torch_index": pools.torch_index(layout, pack),
                             "kvbridge": pools.op(layout, pack, a.threads)},
                            pools.bytes, a.seconds, trials)
            res = row("cpu", layout, "pack" if pack else "unpack", page_size, pools.bytes,
                      page_bytes, r, "dst.copy_(src)")
            log(f"cpu  {layout:<17} {res['direction']:<6} page_size {page_size:3d} "
                f"({page_size * ROW_BYTES >> 10:4d} KiB per layer and K/V): {describe(res)}")
            results.append(res)
        del pools
        vp = VllmPools(pages, page_size, torch.device("cpu"))
        r = measure_cpu({"copy": vp.plain_copy(), "torch_index": vp.torch_index(),
                         "kvbridge": vp.op(a.threads)}, vp.bytes, a.seconds, trials)
        res = row("cpu", "vllm " + VLLM_LAYOUT, "pack", page_size, vp.bytes, page_bytes, r,
                  "dst.copy_(src)")
        log(f"cpu  vllm flashinfer     pack   block_size {page_size:3d}: {describe(res)}")
        results.append(res)
        del vp
    return results


def run_gpu(a) -> dict:
    ok, reason = ops.cuda_available()
    if not ok:
        log(f"gpu: not measured: {reason}")
        return {"available": False, "reason": reason}
    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(dev)
    log(f"gpu: {name}")
    reps = 10 if a.quick else 30
    results, head_value, head_base = [], [], []
    for page_size in (16, 32, 64):
        pages = a.pages or (1024 if a.quick else 2048) * 32 // page_size  # 1 or 2 GiB a pool
        page_bytes = LAYERS * 2 * page_size * ROW_BYTES
        pools = SglangPools(pages, page_size, dev, dev)
        d2d = gpu_rate(pools.plain_copy(True), pools.bytes, reps)
        for layout, pack in SGLANG_CASES:
            r = {"copy": d2d,
                 "torch_index": gpu_rate(pools.torch_index(layout, pack), pools.bytes, reps),
                 "kvbridge": gpu_rate(pools.op(layout, pack, 0), pools.bytes, reps)}
            res = row("cuda", layout, "pack" if pack else "unpack", page_size, pools.bytes,
                      page_bytes, r, "device-to-device copy_", memory="device")
            log(f"gpu  {layout:<17} {res['direction']:<6} to device      page_size "
                f"{page_size:3d}: {describe(res)}")
            results.append(res)
            if layout == "page_first" and pack and page_size * ROW_BYTES >= 64 * 1024:
                head_value.append(r["kvbridge"])
                head_base.append(d2d)
        vp = VllmPools(pages, page_size, dev)
        r = {"copy": gpu_rate(vp.plain_copy(), vp.bytes, reps),
             "torch_index": gpu_rate(vp.torch_index(), vp.bytes, reps),
             "kvbridge": gpu_rate(vp.op(0), vp.bytes, reps)}
        res = row("cuda", "vllm " + VLLM_LAYOUT, "pack", page_size, vp.bytes, page_bytes, r,
                  "device-to-device copy_", memory="device")
        log(f"gpu  vllm flashinfer     pack   to device      block_size {page_size:3d}: "
            f"{describe(res)}")
        results.append(res)
        del vp
        # page_first into pinned host memory, against a device-to-host copy.
        pinned = SglangPools(pages, page_size, dev, "cpu", pin=True)
        few = max(2, reps // 5)
        r = {"copy": gpu_rate(pinned.plain_copy(True), pinned.bytes, few),
             "torch_index": gpu_rate(pinned.torch_index("page_first", True), pinned.bytes, few),
             "kvbridge": gpu_rate(pinned.op("page_first", True, 0), pinned.bytes, few)}
        res = row("cuda", "page_first", "pack", page_size, pinned.bytes, page_bytes, r,
                  "device-to-host copy_ into pinned memory", memory="pinned host")
        log(f"gpu  page_first        pack   to pinned host page_size {page_size:3d}: "
            f"{describe(res)}")
        results.append(res)
        del pools, pinned
        torch.cuda.empty_cache()
    value = sum(head_value) / len(head_value)
    base = sum(head_base) / len(head_base)
    return {"available": True, "device": name, "headline": {
        "metric": "page_first pack GB/s (CUDA, >=64KiB per layer and K/V) / device-to-device "
                  "copy GB/s",
        "value": round(value, 1), "baseline": round(base, 1),
        "baseline_name": "torch device-to-device copy_ of the same bytes, same run",
        "ratio": ratio(value, base), "goal": 0.85}, "results": results}


def main(argv=None) -> int:
    a = parse_args(argv)
    log(f"bench_kernels.py: kvbridge.ops, {LAYERS} layers, K and V, rows of {ROW_BYTES} bytes "
        f"(bf16), {a.threads} CPU threads, device {a.device}{', quick' if a.quick else ''}")
    if a.device == "cuda" and not ops.cuda_available()[0]:
        log(f"bench_kernels.py: --device cuda: {ops.cuda_available()[1]}")
        return 1
    cpu = run_cpu(a) if a.device != "cuda" else []
    gpu = run_gpu(a) if a.device != "cpu" else {"available": False,
                                                  "reason": "--device cpu"}
    out = {"benchmark": "kernels", "implementation": "kvbridge.ops (torch custom ops)",
           "quick": a.quick, "threads": a.threads,
           "config": {"layers": LAYERS, "kv": 2, "heads": HEADS, "head_dim": HEAD_DIM,
                      "dtype": "bfloat16", "row_bytes": ROW_BYTES, "device": a.device,
                      "seconds": a.seconds, "torch": torch.__version__,
                      "torch_index": "index_select + index_copy_ per layer and K/V, page "
                                     "indices"}}
    if cpu:
        pf = [r for r in cpu if r["layout"] == "page_first" and r["direction"] == "pack"]
        value = sum(r["gbps"] for r in pf) / len(pf)
        base = sum(r["baseline_gbps"] for r in pf) / len(pf)
        out["headline"] = {
            "metric": "page_first pack GB/s (CPU) / copy GB/s", "value": round(value, 3),
            "baseline": round(base, 3),
            "baseline_name": "torch dst.copy_(src) of the same bytes, same threads, same run",
            "ratio": ratio(value, base), "goal": 0.6}
    else:
        out["headline"] = gpu["headline"]
    out["gpu"] = gpu
    out["results"] = cpu
    emit(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
