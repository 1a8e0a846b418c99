"""What pyproject.toml cannot say: the wheel ships the repository's ``server_models/`` inside the package.

The models stay at the repository root, where the README, the tests and ``triton-npu serve`` in a
checkout expect them; the wheel carries them as ``triton_npu_client/server_models`` so that
``LocalTriton()`` and ``triton-npu serve`` find them after a plain ``pip install``. Every other
setting lives in pyproject.toml.
"""

from setuptools import find_packages, setup

MODELS = "triton_npu_client.server_models"

setup(
    packages=[*find_packages(include=["triton_npu_client", "triton_npu_client.*"]), MODELS],
    package_dir={MODELS: "server_models"},
    # Exactly the files package_data names (nothing picked up from a manifest): setuptools otherwise
    # warns that model folders such as scale_fp32/ look like packages missing from the list above.
    include_package_data=False,
    # Every file of every model (config.pbtxt, model.py, any weights or labels beside them).
    package_data={"triton_npu_client": ["py.typed"], MODELS: ["**/*"]},
    exclude_package_data={MODELS: ["**/__pycache__/*", "**/*.pyc"]},
)
