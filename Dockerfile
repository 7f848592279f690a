# syntax=docker/dockerfile:1
# megatron-gspo for GPU nodes.
#
#   docker build -t megatron-gspo .
#   docker run --gpus all --ipc=host --shm-size=16g -v /models:/models -v /runs:/runs \
#       megatron-gspo train --config configs/tiny_moe_gspo.yaml --run-dir /runs/tiny \
#       model.path=/models/task_model
#
#   (the model comes from a mount: make it with `megatron-gspo make-task-model --out
#   /models/task_model`; docs/deployment.md, "Container")
#
# - Base: NGC PyTorch. It carries CUDA, NCCL, Transformer Engine and apex built against its own
#   torch; everything installed here is constrained to that torch so pip never replaces it.
# - megatron-core: pinned inside pyproject's range (tests/unit/test_launch.py checks the pins).
# - SGLang pins its own torch build, so it lives in its own virtual environment,
#   /opt/sglang-venv (SGLANG_PYTHON), together with sglang-router. Rollout servers run as
#   separate processes anyway; the trainer only talks HTTP (and NCCL / CUDA IPC) to them.
#   SGLang is the version the contract tests check (scripts/sglang_env.sh).
# - The project in /opt/megatron-gspo (MEGATRON_GSPO_HOME: its launch/ and configs/, where
#   `megatron-gspo study` reads its arms' configs, the package itself being installed into
#   site-packages), run as the non-root user `gspo`; the entrypoint is the `megatron-gspo`
#   command. A Slurm batch script runs on the host and reads the host's MEGATRON_GSPO_HOME.
FROM nvcr.io/nvidia/pytorch:25.11-py3

ARG MEGATRON_CORE_VERSION=0.16.1
ARG SGLANG_VERSION=0.5.23
ARG SGLANG_ROUTER_VERSION=0.3.2
ARG USER_UID=1001

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    MEGATRON_GSPO_HOME=/opt/megatron-gspo \
    SGLANG_PYTHON=/opt/sglang-venv/bin/python \
    PIP_CONSTRAINT=/opt/megatron-gspo/ngc-constraints.txt

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
WORKDIR /opt/megatron-gspo

# Keep the base image's torch, Transformer Engine, apex and their CUDA builds exactly as shipped.
RUN python -c "import importlib.metadata as m; \
names = ('torch', 'transformer-engine', 'apex', 'triton', 'numpy', 'flash-attn'); \
found = [n for n in names if any(d.metadata['Name'].lower() == n for d in m.distributions())]; \
print('\n'.join(f'{n}=={m.version(n)}' for n in found))" > ngc-constraints.txt \
    && cat ngc-constraints.txt

# Dependencies first, read from pyproject (a code change does not reinstall them), then the
# project itself without touching them.
COPY pyproject.toml README.md ./
RUN python -c "import tomllib; \
print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > requirements.txt \
    && pip install "megatron-core==${MEGATRON_CORE_VERSION}" -r requirements.txt
COPY megatron_gspo ./megatron_gspo
RUN pip install --no-deps . \
    && python -c "import megatron.core, transformer_engine, megatron_gspo; \
print('megatron-core', megatron.core.__version__)"

# SGLang and its router in their own environment (they bring their own torch).
RUN python -m venv /opt/sglang-venv \
    && env -u PIP_CONSTRAINT /opt/sglang-venv/bin/pip install \
        "sglang==${SGLANG_VERSION}" "sglang-router==${SGLANG_ROUTER_VERSION}" \
    && env -u PIP_CONSTRAINT /opt/sglang-venv/bin/python -c "import sglang, sglang_router; \
print('sglang', sglang.__version__)"

COPY launch ./launch
COPY configs ./configs
COPY tools ./tools
COPY scripts ./scripts

RUN useradd --create-home --uid "${USER_UID}" --shell /bin/bash gspo \
    && mkdir -p /runs \
    && chown gspo /runs
USER ${USER_UID}

ENTRYPOINT ["megatron-gspo"]
CMD ["--help"]
