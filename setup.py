"""Build script: the C backends are compiled by cffi in out-of-line API mode."""
from setuptools import find_packages, setup

#: What the optional figures need: matplotlib 3.7 added legends placed outside the axes.
PLOT = ["matplotlib>=3.7"]
#: The HuggingFace hook (kvemu/realrun/hf.py) subclasses DynamicCache; tested with transformers 5.24 on
#: torch 2.13 (CPU). torch is installed separately, so that pip does not pick a build for you:
#: `pip install torch` (the CPU wheel where one is offered) or your CUDA build, before `kvemu[hf]`.
HF = ["transformers>=5,<6"]
#: Importing vLLM KV cache events (kvemu/realrun/vllm_events.py): the capture files are msgpack.
VLLM = ["msgpack>=1.0"]
#: Sweeps on a Dask cluster (kvemu/sweep.py, docs/scale-out.md): `kvemu sweep --executor dask://HOST:PORT`.
DASK = ["dask[distributed]"]
#: Mooncake Store as a tier (`--backend mooncake`, kvemu/stores/mooncake.py): its master and store client
#: without CUDA (tested with 0.3.13.post1); the client also needs libibverbs (`apt-get install libibverbs1`).
MOONCAKE = ["mooncake-transfer-engine-non-cuda>=0.3.13"]
#: The measured-kernel compute model (kvemu/engine/aic.py, docs/engine.md "Compute backends"):
#: `kvemu record --compute aiconfigurator`. Tested with 0.12.0 (its estimate API: MixedStepInput).
AIC = ["aiconfigurator-core>=0.12,<0.13"]

setup(
    name="kvemu",
    version="0.1.0",
    description="Record LLM KV-cache access traces and replay them on real memory and storage tiers",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=find_packages(include=["kvemu", "kvemu.*"]),
    package_data={"kvemu": ["data/*"]},
    setup_requires=["cffi>=1.15"],
    cffi_modules=["cbackends/build_ffi.py:ffibuilder"],
    install_requires=["cffi>=1.15", "numpy>=1.24", "pyarrow>=12", "click>=8.1"],
    extras_require={
        # Figures of the HTML report (kvemu/plots.py); the tests draw them too.
        "plot": PLOT,
        # Real-run sources (docs/sources.md).
        "hf": HF,
        "vllm": VLLM,
        "dask": DASK,
        "mooncake": MOONCAKE,
        "aic": AIC,
        "test": ["pytest>=7", "hypothesis>=6", "duckdb>=1.0", "msgpack>=1.0", *PLOT, *DASK],
    },
    entry_points={"console_scripts": ["kvemu=kvemu.__main__:main"]},
    zip_safe=False,
)
