# The tfpar image for Kubernetes (python -m tfpar.k8s render --image=...).
#   docker build -t REGISTRY/tfpar:TAG . && docker push REGISTRY/tfpar:TAG
# Not built here (no Docker daemon on the development machine); tests/test_k8s.py
# checks that it installs the package as README says and runs tini as PID 1.
FROM python:3.11-slim

# tini as PID 1 forwards SIGTERM to Python: the kernel drops signals a PID 1
# has not installed a handler for, so a bare `python` would not get them.
RUN apt-get update \
    && apt-get install -y --no-install-recommends tini \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
COPY setup.py ./
COPY tfpar tfpar
COPY configs configs
RUN pip install --no-cache-dir .

# An unprivileged user (uid 1000, the manifests' runAsUser and fsGroup).
RUN useradd --uid 1000 --create-home tfpar
USER 1000
ENV PYTHONUNBUFFERED=1

ENTRYPOINT ["tini", "--"]
CMD ["python", "-m", "tfpar.train", "--flagfile=configs/gpt_tiny.flags", "--model_dir=/tmp/runs/gpt_tiny"]
