"""Packaging for veScale Engine.

The version ranges are the ones CI tests at both ends: the lowest versions
(.ci/lowest-constraints.txt, CI's second pass) and the newest releases below each cap (its first
pass); vescale_engine/versions.py lists the same ranges and refuses a version below them at
`patch_deepspeed()` / `initialize`; tests/integration/test_versions.py keeps the three equal. The
[hf] floors admit the versions LLaMA-Factory 0.9.5 and axolotl 0.19.0 pin.

On a machine without a GPU, install torch's CPU build first (`bash .ci/setup-venv` does), so
that pip does not pull a multi-GB CUDA build.
"""
from setuptools import find_packages, setup

HF = ["transformers>=5.6.0,<5.26", "accelerate>=1.11.0,<1.17", "safetensors>=0.4.3",
      "peft>=0.18.1,<0.22", "trl>=0.24.0,<1.17", "datasets>=4.0.0,<5.3"]

setup(
    name="vescale-engine",
    version="0.1.0",
    description="veScale-FSDP training engine: RaggedShard, a layout planner and zero-copy "
                "distributed buffers behind a DeepSpeed-style API",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["vescale_engine", "vescale_engine.*", "config_schemas",
                                    "launcher"]),
    package_data={"config_schemas": ["*.json"],
                  "vescale_engine.plan.step_time": ["clusters/*.json"]},
    install_requires=[
        "torch>=2.11.0,<2.16",
        "deepspeed>=0.19.3,<0.20",
        "py-cpuinfo",
        "jsonschema>=4.18.0",
    ],
    extras_require={
        "mpi": ["mpi4py>=3.1", "openmpi"],
        "plot": ["matplotlib"],
        # Hugging Face models and checkpoints: our reader/writer needs none of these at run
        # time; the tests build tiny LlamaForCausalLM models and check from_pretrained, and run
        # PEFT LoRA and TRL's SFT, DPO and GRPO trainers.
        "hf": HF,
        "test": ["pytest>=8.0.0", "matplotlib", *HF],
    },
    entry_points={"console_scripts": ["vescale = launcher.cli:main"]},
)
