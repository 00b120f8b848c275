# megalm on PyTorch's own CUDA image (CUDA, cuDNN, NCCL, PyTorch and Triton; devel: a compiler for Triton).
# torch here must satisfy pyproject.toml's floor (torch>=2.11: the GPU image is what sets it).
# Build: docker build -t megalm .   Run (the run dir kept on the host): docker run --gpus all --ipc=host -it
#   -v "$PWD/outputs:/workspace/megalm/outputs" megalm megalm-train model=125m precision=bf16
FROM pytorch/pytorch:2.11.0-cuda12.8-cudnn9-devel

WORKDIR /workspace/megalm
COPY pyproject.toml README.md ./
COPY megalm ./megalm
COPY configs ./configs
COPY scripts ./scripts
COPY tools ./tools
# Editable install keeps configs/ next to the package, where megalm-train looks for them.
# torch is already in the image and satisfies the range in pyproject.toml, so pip keeps it.
RUN pip install --no-cache-dir -e ".[tensorboard]"

CMD ["megalm-train", "--help"]
