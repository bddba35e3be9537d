"""Install: ``pip install -e .`` (CPU/CUDA), ``pip install -e .[xla]`` for TPU / XLA:CPU, ``[examples]``
for examples/ (progress bars, plots).

The package (everything but ``torch_tpu_embedding/xla/``) supports torch >= 2.9; CI tests it on torch
2.9.0 with torch_xla 2.9.0 (.ci/requirements.txt) and on torch 2.13.0's CPU build without torch_xla
(.ci/requirements-torch213.txt). torch_xla 2.9 is its last release and needs torch 2.9, hence the
``[xla]`` pins."""

from setuptools import find_packages, setup

XLA = ["torch==2.9.0", "torch_xla==2.9.0"]  # torch_xla declares no torch pin: pin both together
# examples/movielens.py also reads MovieLens-100k from `pip install --no-deps recbole==1.2.1`
# (not an extra: its own dependencies are not needed and --no-deps cannot be expressed here).
EXAMPLES = ["tqdm>=4.60", "matplotlib>=3.7"]
TEST = ["pytest>=8", "numpy>=1.26", "hypothesis>=6.100", "ruff>=0.6", "mypy>=1.11", "keras>=3.12"]

setup(
    name="torch_tpu_embedding",
    version="0.1.0",
    description="Large embedding tables for PyTorch on Cloud TPU: row-sparse lookups and optimizers.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["torch_tpu_embedding", "torch_tpu_embedding.*"]),
    package_data={"torch_tpu_embedding": ["py.typed"]},
    python_requires=">=3.10",
    install_requires=["torch>=2.9", "numpy>=1.26"],
    extras_require={"xla": XLA, "examples": EXAMPLES, "test": TEST, "dev": XLA + EXAMPLES + TEST},
    license="Apache-2.0",
)
