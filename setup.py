"""Packaging for veScale Engine.

torch is required as a range that includes 2.13. On a machine without a GPU, install the CPU
build first (`bash .ci/setup-venv` does), so that pip does not pull a multi-GB CUDA build.
"""
from setuptools import find_packages, setup

setup(
    name="vescale-engine",
    version="0.1.0",
    description="veScale-FSDP training engine: RaggedShard, a layout planner and zero-copy "
                "distributed buffers behind a DeepSpeed-style API",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["vescale_engine", "vescale_engine.*", "config_schemas",
                                    "launcher"]),
    package_data={"config_schemas": ["*.json"]},
    install_requires=[
        "torch>=2.4,<2.15",
        "deepspeed>=0.15",
        "py-cpuinfo",
        "jsonschema>=4.18",
    ],
    extras_require={
        "mpi": ["mpi4py>=3.1", "openmpi"],
        "plot": ["matplotlib"],
        # Hugging Face models and checkpoints: our reader/writer needs none of these at run
        # time; the tests build tiny LlamaForCausalLM models and check from_pretrained, and run
        # PEFT LoRA and TRL's SFT, DPO and GRPO trainers (tests/test_trl.py: the versions
        # tested are the lower bounds).
        "hf": ["transformers>=5.0", "accelerate>=1.0", "safetensors>=0.4", "peft>=0.21.2",
               "trl>=1.16.0", "datasets>=5.2.0"],
        "test": ["pytest>=7", "matplotlib", "transformers>=5.0", "accelerate>=1.0",
                 "safetensors>=0.4", "peft>=0.21.2", "trl>=1.16.0", "datasets>=5.2.0"],
    },
    entry_points={"console_scripts": ["vescale = launcher.cli:main"]},
)
