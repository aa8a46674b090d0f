"""The bounce settings the host-speed benchmarks compare (bench_host.py, bench_net_dpdk.py):
variant name -> `--bounce` option string of bouncevm-vhost."""

VARIANTS = {
    "off": "policy=off",
    "swiotlb": "policy=force,mode=swiotlb,alloc=areas",
    "iova": "policy=force,mode=iova,alloc=iova-rcache",
    # The same with the pool's time accounting off (bounce option timing=off; it times a sample
    # of the calls, about 1 in 16, so the difference is small now).
    "swiotlb-untimed": "policy=force,mode=swiotlb,alloc=areas,timing=off",
    "iova-untimed": "policy=force,mode=iova,alloc=iova-rcache,timing=off",
    # swiotlb with the allocators that reuse the most recently freed (cache-hot) slots.
    "swiotlb-magazine": "policy=force,mode=swiotlb,alloc=magazine",
    "swiotlb-areas-lifo": "policy=force,mode=swiotlb,alloc=areas-lifo",
    "swiotlb-magazine-untimed": "policy=force,mode=swiotlb,alloc=magazine,timing=off",
    # Each mode with the other's copy rule on map (bounce option copy-on-map): iova copying the
    # original in whatever the direction, as swiotlb does; swiotlb copying in only what the
    # device reads, as VDUSE does (and as swiotlb did before its 2022 info-leak fix).
    "iova-copy-in": "policy=force,mode=iova,alloc=iova-rcache,copy-on-map=always",
    "swiotlb-magazine-no-copy-in":
        "policy=force,mode=swiotlb,alloc=magazine,copy-on-map=when-device-reads",
}
