"""The benchmark suite (not part of the kparallax library).

    benchmark        the driver: runs variants side by side (``kparallax-bench``, ``scripts/benchmark.py``)
    worker           one run of one variant (started by the driver)
    traffic          analytic bytes per step of each variant (the floors)
    netem            emulated hosts and links (network namespaces, tc) for multi-host runs on one machine
    link_check       bursts alone on emulated links: raw TCP and TensorFlow's transport against the link rate
    cpu, op_profile  where a step's time goes: CPU by role from /proc; TF profiler traces (ops, every worker's phases)
    project_scaling  the projection to many workers, validated against measured runs
    outputs          the scripts' output files: their directories checked before a run
"""
