"""kparallax: sparsity-aware data-parallel training of tf.keras models (Parallax for TensorFlow 2)."""

from setuptools import find_packages, setup

setup(
    name="kparallax",
    version="0.1.0",
    description="Hybrid allreduce + parameter-server training of unchanged tf.keras models",
    packages=find_packages(include=["kparallax", "kparallax.*", "kparallax_models", "kparallax_bench"]),
    package_data={"kparallax": ["_compat/native/*.c"], "kparallax_models": ["configs/*.json"]},
    python_requires=">=3.11,<3.12",
    install_requires=[
        "tensorflow-cpu==2.15.1",
        "horovod==0.28.1",
        "absl-py",
        "tensorboard",
        "portpicker",
        "pyyaml",
    ],
    extras_require={"test": ["pytest", "pytest-timeout"]},
    entry_points={"console_scripts": [
        "kparallax-run=kparallax.launch.cli:main",
        "kparallax-ps=kparallax.cluster.ps_server:run",
        "kparallax-bench=kparallax_bench.benchmark:main",
        "kparallax-project-scaling=kparallax_bench.project_scaling:main",
    ]},
)
