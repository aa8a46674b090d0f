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


def select(names, custom=(), builtin=None):
    """The variants a benchmark runs, in order, as {label: `--bounce` string}.

    `names` are the `--variants` list (names of `builtin`, VARIANTS by default; a peer that is
    not ours, like bench_host's "qsd", maps to None); `custom` are `--variant LABEL=OPTS`
    definitions, run after them under their own label, so any option string (an A/A control,
    another pool size) can be measured without editing this file. Raises ValueError with a
    one-line message on an unknown name, a label already taken, or a label the benchmarks'
    row names could not carry (empty, or holding , : @ =)."""
    builtin = VARIANTS if builtin is None else builtin
    chosen = {}
    for name in names:
        if name not in builtin:
            raise ValueError(f"unknown variant {name!r} (expected one of {', '.join(builtin)}, "
                             "or define one with --variant LABEL=OPTS)")
        if name in chosen:
            raise ValueError(f"variant {name!r} is named twice")
        chosen[name] = builtin[name]
    for spec in custom:
        label, eq, opts = spec.partition("=")
        if not eq or not label or not opts or any(c in label for c in ",:@="):
            raise ValueError(f"--variant {spec!r}: expected LABEL=OPTS, a label without , : @ = "
                             "and a non-empty --bounce string")
        if label in builtin or label in chosen:
            raise ValueError(f"--variant {spec!r}: the label {label!r} is taken")
        chosen[label] = opts
    return chosen


def defined_lines(chosen, builtin=None):
    """The `LABEL: --bounce OPTS` line a benchmark prints under its table for each variant of
    `chosen` that was defined with --variant (not in `builtin`), in the order given."""
    builtin = VARIANTS if builtin is None else builtin
    return [f"{label}: --bounce {opts}" for label, opts in chosen.items() if label not in builtin]
