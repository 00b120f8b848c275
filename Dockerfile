# megalm on an NGC PyTorch image (CUDA, NCCL, PyTorch and Triton included).
# Build: docker build -t megalm .   Run: docker run --gpus all --ipc=host -it megalm megalm-train model=125m precision=bf16
FROM nvcr.io/nvidia/pytorch:25.01-py3

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
