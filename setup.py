from setuptools import find_packages, setup

setup(
    name="autopar",
    version="0.1.0",
    description="Auto-parallelizing compiler for PyTorch training",
    packages=find_packages(include=["autopar*", "cost_models*", "solver*", "codegen*"]),
    package_data={"cost_models": ["tables/*.json"]},   # the GPU efficiency tables (cost_models.efficiency)
    python_requires=">=3.10",
    # torch is pinned narrowly: autopar relies on private DTensor APIs that move between releases.
    install_requires=[
        "torch>=2.13.0,<2.14",
        "networkx>=3.0",
        "ortools>=9.12,<10",   # solver.ilp calls math_opt's solver binding directly
        "sympy>=1.12",
        # the status line of long work (autopar.core.progress): terminal width, redraws that log
        # lines do not tear, and erasing it at the end, as every terminal needs
        "tqdm>=4.66",
    ],
    # The model corpus (tests/test_corpus.py) is Hugging Face 5's models as from_config builds them:
    # their mask building, and the experts operator that MoE models run. peft: LoRA adapters as
    # get_peft_model returns them, frozen base weights (tests/test_frozen.py).
    extras_require={"test": ["pytest>=8", "transformers>=5.23,<6", "peft>=0.21"]},
    entry_points={"console_scripts": ["autopar=autopar.cli:main"]},
)
